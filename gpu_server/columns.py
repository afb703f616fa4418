"""The report files' column headers, exactly as msprobe users know them (docs/design.md §6.6).

Every writer and every reader of the reports takes its headers from here; nothing else spells them.
"""

RESULT_HEADER = ["API name", "Forward Test Success", "Backward Test Success", "Message"]

# Per-output metric columns of accuracy_checking_details, in file order, keyed by the attribute name of
# gpu_server.judging.metrics.OutputMetrics that fills each one.
METRIC_COLUMNS = [
    ("cosine", "余弦相似度"),
    ("max_abs_err", "最大绝对误差"),
    ("hundredth", "双百指标"),
    ("thousandth", "双千指标"),
    ("ten_thousandth", "双万指标"),
    ("binary_error_rate", "二进制一致错误率"),
    ("error_balance", "误差均衡性"),
    ("rmse", "均方根误差"),
    ("small_value_error_ratio", "小值域错误占比"),
    ("max_rel_err", "相对误差最大值"),
    ("mean_rel_err", "相对误差平均值"),
    ("inf_nan_error_rate", "inf/nan错误率"),
    ("rel_err_rate", "相对误差错误率"),
    ("abs_err_rate", "绝对误差错误率"),
    ("ulp_max", "ULP误差最大值"),
    ("ulp_mean", "ULP误差平均值"),
    ("ulp_over_threshold", "ULP误差大于阈值占比"),
]

DETAILS_HEADER = (["API Name", "Bench Dtype", "DEVICE Dtype", "Shape"]
                  + [title for _, title in METRIC_COLUMNS] + ["Status", "Message"])

PRECISION_RESULT_HEADER = ["API Name", "Forward Test Success", "Backward Test Success", "Message"]

PRECISION_DETAILS_HEADER = [
    "API Name", "小值域错误比值", "小值域判定结果", "均方根误差比值", "均方根误差判定结果", "相对误差最大值比值",
    "相对误差最大值判定结果", "相对误差平均值比值", "相对误差平均值判定结果", "误差均衡性比值", "误差均衡性判定结果",
    "inf/nan错误率", "inf/nan判定结果", "相对误差错误率", "相对误差判定结果", "绝对误差错误率", "绝对误差判定结果",
    "二进制一致错误率", "二进制一致错误率判定结果", "ULP误差平均值", "ULP误差大于阈值占比", "ULP误差大于阈值占比比值",
    "ULP误差判定结果", "双千指标", "双千指标判定结果", "比对结果", "比对算法", "Message",
]

# collective_result_{ts}_rank{r}.csv (our own file): one row per collective record of the rank, matched across the
# member ranks (gpu_server/checking/collectives.py). Status: the record's result row's; Finding: matched, mismatch,
# missing,
# unfinished or evicted; Message: the finding's message (for a matched collective with an error, which ranks failed).
COLLECTIVE_HEADER = ["API Name", "Group", "Ranks", "Group Seq", "Reduce Op", "Dtype", "Shape", "Status", "Finding",
                     "Message"]

# Our own columns, always after msprobe's: the training step, the record's sequence number (per run and rank), the
# module path the call ran in ("TinyLM.blocks.0.attn.proj") and the user's line that made it ("train.py:42 (forward)").
EXTRA_COLUMNS = ["Step", "Seq", "Module", "Source"]

# Our own precision-standard columns of api_precision_compare_details, after msprobe's columns and after EXTRA_COLUMNS
# (so that neither moves): the mixed-tolerance standard's pass rate, its largest error over the allowed one and its
# verdict, the quantisation standard's largest |device - bench| and its verdict (docs/standards.md). Blank in rows
# other standards judge.
PRECISION_EXTRA_COLUMNS = ["混合容差通过率", "混合容差最大误差比值", "混合容差判定结果", "量化误差最大值",
                           "量化误差判定结果"]

BLANK = " "  # a cell a check does not set
FLOAT_DECIMALS = 14
