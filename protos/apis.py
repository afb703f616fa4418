"""Which API calls the server replays, with which arguments, and which of them are random or uninitialised.

The one place for name-based lists shared by the agent (npu_agent/naming.py: which calls carry generator state) and
the server (gpu_server/replay/registry.py: what may be resolved and called; gpu_server/replay/run.py: how random and
uninitialised outputs are replayed). How to add an API: docs/security.md, "What the server replays".

A call is replayable when its name is in the allowlist of its category and every argument leaf is a tensor, a
number, a bool, None, a dtype, a shape, a memory format, the strided layout (sparse and other layouts build tensors
whose index arrays kernels trust), a slice, Ellipsis or a device (replaced by the bench device), nested in tuples,
lists and mappings, and every string is one of the values the API documents for that parameter (`STRINGS`) or a
device string such as 'cpu' or 'npu:0' given as `device` (`is_device_string`: a device is data, the replay puts the
bench device there; factories such as `torch.tensor(1.0, device='cpu')` are replayed and compared). Nothing
that does I/O, starts processes, imports modules, changes global defaults or seeds a generator is in the allowlist;
tests/test_allowlist.py enumerates the tables and checks that by name and by calling.
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from protos.codec import Opaque
from protos.limits import CUSTOM


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# -- element-wise math shared by torch.*, Tensor methods and aten (each also has an in-place `name_` Tensor form) --
_ELEMENTWISE = _names("""
abs absolute acos arccos acosh arccosh add addcdiv addcmul angle asin arcsin asinh arcsinh atan arctan atan2 arctan2
atanh arctanh bitwise_and bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift bitwise_xor ceil clamp clip
clamp_max clamp_min conj_physical copysign cos cosh deg2rad digamma div divide eq erf erfc erfinv exp exp2 expm1 fix
float_power floor floor_divide fmod frac gcd ge greater_equal gt greater heaviside hypot i0 igamma igammac lcm ldexp
le less_equal lerp lgamma log log10 log1p log2 logical_and logical_not logical_or logical_xor logit lt less mul
multiply mvlgamma nan_to_num ne not_equal neg negative nextafter polygamma pow rad2deg reciprocal remainder renorm
round rsqrt sgn sigmoid sign sin sinc sinh sqrt square sub subtract tan tanh true_divide trunc xlogy relu
""")

# -- out-of-place torch.* (and the same names as Tensor methods / aten ops where they exist) --
_TORCH_MATH = _names("""
logaddexp logaddexp2 maximum minimum fmax fmin signbit isfinite isinf isnan isneginf isposinf isreal isclose allclose
equal positive conj resolve_conj resolve_neg frexp rsub hardshrink
real imag view_as_real view_as_complex polar complex
""")
_REDUCTIONS = _names("""
sum nansum prod mean nanmean std var std_mean var_mean max min amax amin aminmax argmax argmin all any norm
logsumexp median nanmedian mode quantile nanquantile count_nonzero cumsum cumprod cummax cummin logcumsumexp
kthvalue topk sort argsort msort unique unique_consecutive bincount histc dist renorm trace diff cov corrcoef
""")
_LINALG = _names("""
mm bmm matmul mv dot vdot inner outer ger addmm addbmm baddbmm addmv addr chain_matmul einsum tensordot kron cross
det logdet slogdet inverse pinverse matrix_power matrix_exp cholesky cholesky_solve cholesky_inverse qr svd lu_solve
triangular_solve cdist trapezoid trapz cumulative_trapezoid
linalg_norm linalg_vector_norm linalg_matrix_norm linalg_det linalg_slogdet linalg_inv linalg_pinv linalg_solve
linalg_cholesky linalg_qr linalg_svd linalg_svdvals linalg_eigh linalg_eigvalsh linalg_eig linalg_eigvals
linalg_lstsq linalg_matrix_rank linalg_cross linalg_vecdot linalg_multi_dot linalg_matrix_power linalg_matrix_exp
linalg_cond linalg_lu linalg_lu_factor linalg_lu_solve linalg_solve_triangular linalg_householder_product
linalg_tensorinv linalg_tensorsolve linalg_diagonal linalg_inv_ex linalg_cholesky_ex linalg_solve_ex linalg_ldl_factor
linalg_ldl_solve linalg_vander linalg_matmul
fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn
fft_hfft fft_ihfft fft_fftshift fft_ifftshift fft_fftfreq fft_rfftfreq stft istft
special_erf special_erfc special_erfinv special_expit special_logit special_xlogy special_xlog1py special_gammaln
special_digamma special_psi special_polygamma special_multigammaln special_i0 special_i0e special_i1 special_i1e
special_ndtr special_ndtri special_log_ndtr special_log_softmax special_softmax special_logsumexp special_sinc
special_round special_entr special_erfcx special_exp2 special_expm1 special_log1p special_zeta
""")
_SHAPES = _names("""
cat concat concatenate stack hstack vstack dstack column_stack row_stack split tensor_split chunk unbind hsplit
vsplit dsplit reshape view_copy flatten unflatten squeeze unsqueeze transpose swapaxes swapdims permute movedim
moveaxis t adjoint narrow narrow_copy select index_select masked_select gather scatter scatter_add scatter_reduce
index_add index_copy index_fill index_put index_reduce masked_fill masked_scatter take take_along_dim where
nonzero argwhere flip fliplr flipud roll rot90 tile repeat_interleave broadcast_to broadcast_tensors expand_copy
diag diag_embed diagflat diagonal diagonal_scatter select_scatter slice_scatter as_strided_scatter tril triu
tril_indices triu_indices block_diag cartesian_prod combinations meshgrid atleast_1d atleast_2d atleast_3d ravel
clone detach_copy searchsorted bucketize isin embedding one_hot pixel_shuffle pixel_unshuffle channel_shuffle
native_channel_shuffle vander
""")
_FACTORIES = _names("""
zeros ones full zeros_like ones_like full_like arange range linspace logspace eye tensor as_tensor scalar_tensor
empty empty_like empty_strided empty_permuted
""")
_NN_TORCH = _names("""
softmax log_softmax layer_norm group_norm batch_norm instance_norm rms_norm conv1d conv2d conv3d conv_transpose1d
conv_transpose2d conv_transpose3d conv_tbc convolution avg_pool1d max_pool1d max_pool2d max_pool3d
max_pool1d_with_indices adaptive_avg_pool1d adaptive_max_pool1d prelu rrelu selu celu threshold hardshrink
binary_cross_entropy_with_logits cosine_similarity pairwise_distance pdist cosine_embedding_loss
hinge_embedding_loss margin_ranking_loss kl_div poisson_nll_loss ctc_loss embedding_bag bilinear alpha_dropout
feature_alpha_dropout dropout feature_dropout native_dropout native_layer_norm native_batch_norm native_group_norm
native_norm batch_norm_elemt grid_sampler affine_grid_generator
""")
_RANDOM_TORCH = _names("""
rand rand_like randn randn_like randint randint_like randperm bernoulli multinomial normal poisson
""")
_FOREACH = _names("""
_foreach_add _foreach_add_ _foreach_sub _foreach_sub_ _foreach_mul _foreach_mul_ _foreach_div _foreach_div_
_foreach_addcmul _foreach_addcmul_ _foreach_addcdiv _foreach_addcdiv_ _foreach_sqrt _foreach_sqrt_ _foreach_neg
_foreach_neg_ _foreach_lerp _foreach_lerp_ _foreach_norm _foreach_maximum _foreach_maximum_ _foreach_minimum
_foreach_minimum_ _foreach_exp _foreach_exp_ _foreach_abs _foreach_abs_ _foreach_sign _foreach_sign_ _foreach_zero_
_foreach_copy_ _foreach_clamp_max _foreach_clamp_max_ _foreach_clamp_min _foreach_clamp_min_ _foreach_reciprocal
_foreach_reciprocal_ _foreach_pow _foreach_pow_ _foreach_rsqrt _foreach_rsqrt_
_foreach_acos _foreach_acos_ _foreach_asin _foreach_asin_ _foreach_atan _foreach_atan_ _foreach_ceil _foreach_ceil_
_foreach_clone _foreach_cos _foreach_cos_ _foreach_cosh _foreach_cosh_ _foreach_erf _foreach_erf_ _foreach_erfc
_foreach_erfc_ _foreach_expm1 _foreach_expm1_ _foreach_floor _foreach_floor_ _foreach_frac _foreach_frac_
_foreach_lgamma _foreach_lgamma_ _foreach_log _foreach_log_ _foreach_log10 _foreach_log10_ _foreach_log1p
_foreach_log1p_ _foreach_log2 _foreach_log2_ _foreach_max _foreach_powsum _foreach_round _foreach_round_
_foreach_sigmoid _foreach_sigmoid_ _foreach_sin _foreach_sin_ _foreach_sinh _foreach_sinh_ _foreach_tan _foreach_tan_
_foreach_tanh _foreach_tanh_ _foreach_trunc _foreach_trunc_
_fused_adam_ _fused_adamw_ _fused_sgd_ _fused_adagrad_
""")
# torch.* that exist only as functions: in-place math, copies of views, recurrent cells, windows, SyncBatchNorm's
# statistics, more special functions.
_TORCH_MORE = _names("""
acos_ acosh_ arccos_ arccosh_ arcsin_ arcsinh_ arctan_ arctanh_ asin_ asinh_ atan_ atanh_ ceil_ clamp_max_
clamp_min_ conj_physical_ cos_ cosh_ deg2rad_ erf_ erfc_ exp2_ expm1_ fix_ floor_ frac_ gcd_ i0_ lcm_ ldexp_ log_
log10_ log1p_ log2_ logit_ nan_to_num_ negative_ rad2deg_ reciprocal_ round_ sin_ sinc_ sinh_ square_ tan_ trunc_
xlogy_ fill fill_ zero_ index_put_ put constant_pad_nd split_with_sizes unsafe_chunk unsafe_split
unsafe_split_with_sizes alias_copy diagonal_copy permute_copy select_copy slice_copy split_copy split_with_sizes_copy
squeeze_copy t_copy transpose_copy unbind_copy unfold_copy unsqueeze_copy frobenius_norm nuclear_norm norm_except_dim
gru_cell lstm_cell rnn_tanh_cell rnn_relu_cell lstm gru rnn_tanh rnn_relu grid_sampler_2d grid_sampler_3d
hann_window hamming_window bartlett_window blackman_window kaiser_window histogram gradient unravel_index
embedding_renorm_ triplet_margin_loss lu_unpack geqrf orgqr ormqr nonzero_static batch_norm_stats
batch_norm_gather_stats batch_norm_gather_stats_with_counts batch_norm_backward_reduce batch_norm_backward_elemt
batch_norm_update_stats binomial segment_reduce
fft_hfft2 fft_hfftn fft_ihfft2 fft_ihfftn special_airy_ai special_bessel_j0 special_bessel_j1 special_bessel_y0
special_bessel_y1 special_gammainc special_gammaincc special_modified_bessel_i0 special_modified_bessel_i1
special_modified_bessel_k0 special_modified_bessel_k1 special_scaled_modified_bessel_k0
special_scaled_modified_bessel_k1 special_spherical_bessel_j0 special_chebyshev_polynomial_t
special_chebyshev_polynomial_u special_hermite_polynomial_h special_hermite_polynomial_he
special_laguerre_polynomial_l special_legendre_polynomial_p
""")

TORCH = ((_ELEMENTWISE | _TORCH_MATH | _REDUCTIONS | _LINALG | _SHAPES | _FACTORIES | _NN_TORCH | _RANDOM_TORCH
         | _FOREACH | _TORCH_MORE
         | _names("abs_ relu_ sigmoid_ tanh_ exp_ sqrt_ rsqrt_ neg_ dropout_ alpha_dropout_ rrelu_ selu_ celu_ "
                  "threshold_ feature_dropout_ feature_alpha_dropout_ clamp_ clip_"))
         - _names("one_hot"))

FUNCTIONAL = _names("""
linear bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc unfold fold
avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
max_pool3d_with_indices max_unpool1d max_unpool2d max_unpool3d lp_pool1d lp_pool2d lp_pool3d adaptive_avg_pool1d
adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d
adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices adaptive_max_pool3d_with_indices
relu relu_ relu6 elu elu_ selu selu_ celu celu_ leaky_relu leaky_relu_ prelu rrelu rrelu_ glu gelu logsigmoid
hardshrink tanhshrink softsign softplus softmin softmax softshrink gumbel_softmax log_softmax tanh sigmoid hardsigmoid
silu mish hardswish hardtanh hardtanh_ threshold threshold_
batch_norm instance_norm layer_norm group_norm rms_norm local_response_norm normalize
dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout
embedding embedding_bag one_hot pairwise_distance cosine_similarity pdist
binary_cross_entropy binary_cross_entropy_with_logits poisson_nll_loss gaussian_nll_loss cosine_embedding_loss
cross_entropy ctc_loss hinge_embedding_loss kl_div l1_loss mse_loss margin_ranking_loss multilabel_margin_loss
multilabel_soft_margin_loss multi_margin_loss nll_loss huber_loss smooth_l1_loss soft_margin_loss
triplet_margin_loss linear_cross_entropy
pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle pad interpolate upsample upsample_nearest
upsample_bilinear grid_sample affine_grid scaled_dot_product_attention multi_head_attention_forward grouped_mm
""")

# Tensor methods: the element-wise math (out-of-place and in-place), the torch functions that are also methods, and
# the method-only computations, conversions and operators.
_TENSOR_ONLY = _names("""
add_ sub_ mul_ div_ pow_ addcdiv_ addcmul_ addmm_ addbmm_ baddbmm_ addmv_ addr_ clamp_ clip_ copy_ fill_ zero_
fill_diagonal_ index_add_ index_copy_ index_fill_ index_put_ index_reduce_ masked_fill_ masked_scatter_ scatter_
scatter_add_ scatter_reduce_ put_ put lerp_ tril_ triu_ t_ transpose_ squeeze_ unsqueeze_ swapaxes_ swapdims_
cumsum_ cumprod_ renorm_ nan_to_num_ logit_ float_power_ sgn_ xlogy_ true_divide_ floor_divide_ remainder_ fmod_
bernoulli_ uniform_ normal_ exponential_ geometric_ log_normal_ cauchy_ random_ resize_ resize_as_
view view_as reshape_as expand expand_as flatten unflatten contiguous type_as repeat unfold narrow select split
split_with_sizes unsafe_split unsafe_chunk chunk new_zeros new_ones new_full new_empty new_empty_strided
sum_to_size masked_fill to float double half bfloat16 int long short char byte bool cfloat cdouble chalf cpu cuda
softmax log_softmax relu relu_ matmul mm bmm mv dot outer norm abs_ hardshrink prelu
__abs__ __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
__itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ __pow__
__rpow__ __ipow__ __matmul__ __rmatmul__ __neg__ __pos__ __invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__
__xor__ __rxor__ __ixor__ __lshift__ __rlshift__ __ilshift__ __rshift__ __rrshift__ __irshift__ __eq__ __ne__ __lt__
__le__ __gt__ __ge__ __getitem__ __setitem__
""")
TENSOR = ((_TENSOR_ONLY | _ELEMENTWISE | frozenset(n + "_" for n in _ELEMENTWISE) | _TORCH_MATH | _REDUCTIONS
          | (_LINALG & _names("mm bmm matmul mv dot vdot inner outer ger addmm addbmm baddbmm addmv addr kron cross "
                              "det logdet slogdet inverse pinverse matrix_power matrix_exp cholesky cholesky_solve "
                              "cholesky_inverse qr svd lu_solve triangular_solve stft istft"))
          | (_SHAPES - _names("cat concat concatenate stack hstack vstack dstack column_stack row_stack meshgrid "
                              "broadcast_tensors block_diag cartesian_prod combinations tril_indices triu_indices "
                              "atleast_1d atleast_2d atleast_3d one_hot embedding pixel_shuffle pixel_unshuffle "
                              "channel_shuffle native_channel_shuffle vander"))
          | _names("bernoulli multinomial sigmoid tanh exp sqrt rsqrt neg to_dense unsafe_split_with_sizes histogram "
                   "nonzero_static lu geqrf orgqr ormqr"))
          - _names("real imag angle_ bucketize complex detach_copy expand_copy isin polar rsub searchsorted std_mean "
                   "var_mean view_as_complex view_as_real view_copy"))

# aten operators a training reaches directly (`torch.ops.aten.X(...)`): the torch names that are aten operators,
# plus the aten-only forward and backward kernels.
_ATEN_ONLY = _names("""
_softmax _log_softmax _softmax_backward_data _log_softmax_backward_data native_layer_norm native_layer_norm_backward
native_group_norm native_group_norm_backward native_batch_norm native_batch_norm_backward gelu gelu_backward silu
silu_backward sigmoid_backward tanh_backward threshold_backward hardtanh hardtanh_backward leaky_relu
leaky_relu_backward elu elu_backward softplus softplus_backward hardswish hardswish_backward hardsigmoid
hardsigmoid_backward mish mish_backward glu glu_backward convolution convolution_backward embedding_backward
embedding_dense_backward nll_loss nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward
mse_loss mse_loss_backward l1_loss smooth_l1_loss smooth_l1_loss_backward huber_loss huber_loss_backward
binary_cross_entropy binary_cross_entropy_backward cross_entropy_loss max_pool2d_with_indices
max_pool2d_with_indices_backward avg_pool2d avg_pool2d_backward adaptive_avg_pool2d _adaptive_avg_pool2d
_adaptive_avg_pool2d_backward upsample_nearest2d upsample_bilinear2d upsample_nearest2d_backward
upsample_bilinear2d_backward linear addmm mm bmm _to_copy copy expand view _unsafe_view slice select
constant_pad_nd reflection_pad2d replication_pad2d im2col col2im new_zeros new_ones new_full new_empty
new_empty_strided scaled_dot_product_attention fill zero native_dropout native_dropout_backward rms_norm
_fused_rms_norm split_with_sizes
""")
ATEN = ((_ELEMENTWISE | frozenset(n + "_" for n in _ELEMENTWISE) | _TORCH_MATH | _REDUCTIONS | _SHAPES | _FACTORIES
        | _NN_TORCH | _RANDOM_TORCH | _ATEN_ONLY
        | (_LINALG & _names("mm bmm matmul mv dot vdot inner outer addmm addbmm baddbmm addmv addr einsum "
                            "tensordot kron cross det logdet slogdet inverse cdist linalg_vector_norm "
                            "linalg_matrix_norm linalg_norm linalg_inv linalg_solve linalg_qr linalg_svd "
                            "linalg_eigh fft_fft fft_ifft fft_rfft fft_irfft")))
        - _names("angle_ as_tensor tensor unique"))

# torch_npu fused operators the server has a reference for (gpu_server/replay/fused registers exactly these).
NPU = _names("""
npu_fusion_attention npu_rms_norm npu_rotary_mul npu_swiglu npu_scaled_masked_softmax npu_fast_gelu npu_linear
npu_confusion_transpose npu_layer_norm_eval npu_apply_adam npu_apply_adam_w npu_group_norm_silu npu_mish
npu_moe_gating_top_k_softmax npu_sort_v2
""")

# torch.distributed calls the server checks across ranks (never replays): the records of one collective from every
# member rank are matched and judged against the reference computed from all their inputs (docs/collectives.md).
# Any other Distributed call (barrier, scatter, gather, object collectives, batch_isend_irecv) is reported SKIP.
COLLECTIVES = frozenset({"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                         "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single"})
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})
REDUCE_OPS = frozenset({"sum", "avg", "product", "min", "max", "band", "bor", "bxor"})

ALLOWLIST: dict[str, frozenset[str]] = {"Functional": FUNCTIONAL, "Torch": TORCH, "Tensor": TENSOR, "Aten": ATEN,
                                        "NPU": NPU}

# -- strings: the values each API documents, by parameter name (positional strings must be one of them too) --
_REDUCTION = frozenset({"none", "mean", "sum"})
_LOSSES = _names("""
binary_cross_entropy binary_cross_entropy_with_logits poisson_nll_loss gaussian_nll_loss cosine_embedding_loss
cross_entropy ctc_loss hinge_embedding_loss l1_loss mse_loss margin_ranking_loss multilabel_margin_loss
multilabel_soft_margin_loss multi_margin_loss nll_loss huber_loss smooth_l1_loss soft_margin_loss
triplet_margin_loss linear_cross_entropy
""")
_INTERP = frozenset({"nearest", "linear", "bilinear", "bicubic", "trilinear", "area", "nearest-exact"})
_PAD = frozenset({"constant", "reflect", "replicate", "circular"})
_ROUNDING = {"rounding_mode": frozenset({"trunc", "floor"})}
_SCATTER = {"reduce": frozenset({"sum", "prod", "mean", "amax", "amin", "add", "multiply"})}
_NORM = {"p": frozenset({"fro", "nuc"}), "ord": frozenset({"fro", "nuc"})}
_FFT = {"norm": frozenset({"forward", "backward", "ortho"})}
_QUANTILE = {"interpolation": frozenset({"linear", "lower", "higher", "midpoint", "nearest"})}

STRINGS: dict[str, dict[str, frozenset[str]]] = {
    **{name: {"reduction": _REDUCTION} for name in _LOSSES},
    "kl_div": {"reduction": _REDUCTION | {"batchmean"}},
    "gelu": {"approximate": frozenset({"none", "tanh"})},
    "gelu_backward": {"approximate": frozenset({"none", "tanh"})},
    **{name: _ROUNDING for name in ("div", "div_", "divide", "divide_", "__truediv__", "__rtruediv__")},
    **{name: {"padding": frozenset({"valid", "same"})} for name in ("conv1d", "conv2d", "conv3d", "convolution")},
    "pad": {"mode": _PAD},
    "stft": {"pad_mode": _PAD},
    **{name: {"mode": _INTERP} for name in ("interpolate", "upsample")},
    "grid_sample": {"mode": frozenset({"bilinear", "nearest", "bicubic"}),
                    "padding_mode": frozenset({"zeros", "border", "reflection"})},
    "embedding_bag": {"mode": frozenset({"sum", "mean", "max"})},
    **{name: _SCATTER for name in ("scatter", "scatter_", "scatter_reduce", "scatter_reduce_", "index_reduce",
                                   "index_reduce_")},
    "searchsorted": {"side": frozenset({"left", "right"})},
    "segment_reduce": {"reduce": frozenset({"sum", "max", "min", "mean", "prod"})},
    **{name: _NORM for name in ("norm", "linalg_norm", "linalg_matrix_norm", "linalg_cond")},
    "linalg_qr": {"mode": frozenset({"reduced", "complete", "r"})},
    "qr": {"mode": frozenset({"reduced", "complete", "r"})},
    **{name: {"UPLO": frozenset({"L", "U"})} for name in ("linalg_eigh", "linalg_eigvalsh")},
    "cdist": {"compute_mode": frozenset({"use_mm_for_euclid_dist_if_necessary", "use_mm_for_euclid_dist",
                                         "donot_use_mm_for_euclid_dist"})},
    **{name: _QUANTILE for name in ("quantile", "nanquantile")},
    **{name: _FFT for name in _LINALG if name.startswith("fft_") and "shift" not in name and "freq" not in name},
    "npu_fusion_attention": {"input_layout": frozenset({"BSH", "SBH", "BSND", "BNSD", "TND"}),
                             "softmax_layout": frozenset({"", "TND"})},
    "npu_rotary_mul": {"rotary_mode": frozenset({"half", "interleave"})},
}
# Device strings (`x.to("cuda")`, `x.cuda("cuda:0")`, `torch.tensor(1.0, device="cpu")`): data, replaced by the bench
# device like `torch.device` arguments. Accepted as the parameter `device` of any API, and positionally by the APIs
# that take a device first (`_DEVICE_STRING_APIS`); anywhere else a string must be a documented value (`STRINGS`).
DEVICE_STRING = re.compile(r"(cpu|cuda|npu|xpu|mps|hpu|mtia)(:[0-9]{1,4})?\Z")
DEVICE_PARAM = "device"
_DEVICE_STRING_APIS = frozenset({"to", "cuda", "cpu", "_to_copy"})
# einsum equations: letters, commas, spaces, '...' and one '->'.
EINSUM = re.compile(r"[A-Za-z ,]*(\.\.\.[A-Za-z ,]*)*(->[A-Za-z ]*(\.\.\.[A-Za-z ]*)?)?\Z")

_LEAVES = (torch.Tensor, bool, int, float, complex, torch.dtype, torch.memory_format, torch.layout, torch.device,
           type(None), type(Ellipsis))

# -- randomness --
# Draws: the output is the generator's numbers. Replayed in the recorded dtype only (a float64 run draws another
# stream); the bench run is that same replay.
RANDOM_DRAWS = _names("""
rand rand_like randn randn_like randint randint_like randperm bernoulli bernoulli_ multinomial normal normal_ uniform_
exponential_ geometric_ log_normal_ cauchy_ random_ poisson binomial
""")
# Computations with random noise inside: replayed from the recorded generator state in both precisions where that
# reproduces the noise (a CPU bench: the noise does not depend on the dtype there, measured), or with the keep-mask.
RANDOM_INSIDE = _names("""
dropout dropout_ dropout1d dropout2d dropout3d alpha_dropout alpha_dropout_ feature_alpha_dropout
feature_alpha_dropout_ feature_dropout feature_dropout_ native_dropout fused_dropout rrelu rrelu_ gumbel_softmax
scaled_dot_product_attention multi_head_attention_forward npu_fusion_attention
""")
RANDOM = RANDOM_DRAWS | RANDOM_INSIDE
# Dropout-family APIs whose keep-mask the agent rebuilds so that the replay is exact in any precision.
DROPOUT_MASKED = _names("dropout dropout_ dropout1d dropout2d dropout3d feature_dropout feature_dropout_")
# Outputs that are uninitialised memory (whatever was there): never compared.
UNINITIALISED = _names("""
empty empty_like empty_strided empty_permuted new_empty new_empty_strided resize_ resize_as_
""")


def random_arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    """Argument `name` (positional `index`) of a call, or its default."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def random_kind(category: str, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """"draw", "inside" or None (this call uses no randomness: dropout with p=0 or in eval, sdpa without dropout...)."""
    if api in RANDOM_DRAWS:
        return "draw"
    if api not in RANDOM_INSIDE:
        return None
    if api == "scaled_dot_product_attention":
        p = random_arg(args, kwargs, 4, "dropout_p", 0.0)
        return "inside" if isinstance(p, (int, float)) and p > 0 else None
    if api == "npu_fusion_attention":
        keep = random_arg(args, kwargs, 9, "keep_prob", 1.0)
        return "inside" if isinstance(keep, (int, float)) and keep < 1 else None
    if api == "multi_head_attention_forward":
        p, training = random_arg(args, kwargs, 10, "dropout_p", 0.0), random_arg(args, kwargs, 13, "training", True)
        return "inside" if training and isinstance(p, (int, float)) and p > 0 else None
    if api.startswith("rrelu"):
        return "inside" if random_arg(args, kwargs, 3, "training", False) else None
    if api == "gumbel_softmax":
        return "inside"
    if category == "Functional":  # F.*dropout*(input, p=0.5, training=True, inplace=False); alpha: training=False
        p = random_arg(args, kwargs, 1, "p", 0.5)
        training = random_arg(args, kwargs, 2, "training", "alpha" not in api)
    else:                          # torch.dropout(input, p, train), native_dropout(input, p, train)
        p, training = random_arg(args, kwargs, 1, "p", 0.5), random_arg(args, kwargs, 2, "train", True)
    return "inside" if training and isinstance(p, (int, float)) and p > 0 else None


def is_random(api: str) -> bool:
    """By name: calls of this API may draw from the generator (the agent records the generator state)."""
    return api in RANDOM


def uninitialised(api: str) -> bool:
    return api in UNINITIALISED


def _string_ok(api: str, value: str, param: str | None, position: int | None) -> str | None:
    if api == "einsum" and (param == "equation" or position == 0):
        if len(value) <= 256 and EINSUM.match(value):
            return None
        return f"einsum equation {value[:64]!r} is not letters, ',', '...' and '->'"
    if is_device_string(api, value, param):
        return None
    allowed = STRINGS.get(api, {})
    values = allowed.get(param) if param is not None else frozenset().union(*allowed.values())
    if values and value in values:
        return None
    where = f"parameter {param!r}" if param is not None else f"argument {position}"
    return f"string {value[:64]!r} as {where} of {api} is not one of the values it documents"


def _leaf_ok(api: str, leaf: Any, param: str | None, position: int | None, top: bool) -> str | None:
    if isinstance(leaf, str):
        if not top:
            return f"a string inside a sequence or mapping argument of {api}"
        return _string_ok(api, leaf, param, position)
    if isinstance(leaf, torch.layout) and leaf != torch.strided:
        return f"layout {leaf} for {api}: only torch.strided tensors are replayed"
    if isinstance(leaf, _LEAVES) or isinstance(leaf, Opaque):  # Opaque: replay says which type could not travel
        return None
    return f"an argument of type {type(leaf).__name__} to {api}"


def replayable(category: str, api: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> str | None:
    """None when `Category.api(*args, **kwargs)` may be replayed, else the reason ("not replayable: ...")."""
    kwargs = kwargs or {}
    names = ALLOWLIST.get(category)
    if names is None:
        if category == CUSTOM:   # api `namespace.op`: a reference comes only from the server's extension file
            return (f"not replayable: no reference for the custom operator {custom_operator_name(api)}; give one in "
                    "the server's extension file (docs/extensions.md)")
        if category == "Distributed":
            return "not replayable: collective communication is not replayed on the benchmark host"
        return f"not replayable: unknown API category {category[:32]!r}"
    if api not in names:
        if category == "NPU":
            return f"not replayable: no reference implementation for the fused operator {api[:80]} (docs/fused_ops.md)"
        return (f"not replayable: {category}.{api[:80]} is not an API in the server's allowlist of computational "
                "APIs (docs/security.md)")
    # (a tensor, the most frequent argument, is always of an allowed kind: not walked)
    for position, value in enumerate(args):
        if type(value) is not torch.Tensor and (why := _argument_problem(api, value, None, position)):
            return why
    for param, value in kwargs.items():
        if type(value) is not torch.Tensor and (why := _argument_problem(api, value, param, None)):
            return why
    return None


def _argument_problem(api: str, value: Any, param: str | None, position: int | None) -> str | None:
    for leaf, top in _leaves(value):
        why = _leaf_ok(api, leaf, param, position, top)
        if why:
            return f"not replayable: {why}"
    return None


def custom_operator_name(api: str) -> str:
    """A Custom record's api `mylib.fused_gelu` as torch.library names the operator: `mylib::fused_gelu`."""
    return api[:160].replace(".", "::", 1)


def is_device_string(api: str, value: Any, param: str | None = None) -> bool:
    """A device given as a string: as the parameter `device` of any API (`param`, its keyword), or to
    `to`/`cuda`/`cpu`/`_to_copy` positionally. The replay puts the bench device there."""
    if not isinstance(value, str) or DEVICE_STRING.match(value) is None:
        return False
    return param == DEVICE_PARAM or (api in _DEVICE_STRING_APIS and param is None)


def _leaves(value: Any, top: bool = True) -> Iterator[Any]:
    """The leaves of one argument: tuples, lists, mapping values and slices walked (their strings are refused)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v, False)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v, False)
    elif isinstance(value, slice):
        for v in (value.start, value.stop, value.step):
            yield from _leaves(v, False)
    else:
        yield value, top
