"""PrecisionDebugger: the facade a training script uses (docs/design.md §2).

    debugger = PrecisionDebugger(config_path="./config.json")
    debugger.start(); ...; debugger.stop(); debugger.step()
    debugger.close()

Construction validates the config (ConfigError names every bad key) and connects in the background. Nothing
after that raises into the training: the checker's own failures are logged once and counted. A server that can
never accept this agent (a TLS or protocol mismatch) is logged once as an ERROR; capture stops from the next
`start()` on and `close()` returns at once.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
from typing import Any

from npu_agent import freed_memory, location
from npu_agent.capture import CaptureMode, Capturer
from npu_agent.config import AgentConfig, load_config
from npu_agent.records import PendingRecord
from npu_agent.sampling import Policy, Sampler
from npu_agent.sender import Sender
from npu_agent.snapshot import HELD
from npu_agent.transport import Transport
from protos.torch_compat import function_mode_stack

# The agent logs through the "npu_agent" logger and configures nothing: with no logging set up, Python's last-resort
# handler still prints WARNING and ERROR lines to stderr; `logging.basicConfig(level=logging.INFO)` shows the rest.
log = logging.getLogger("npu_agent")


def current_rank() -> tuple[int, int]:
    """(rank, world size): torch.distributed when initialised, else RANK / WORLD_SIZE, else (0, 1). Never None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass

    def env_int(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return env_int("RANK", 0), env_int("WORLD_SIZE", 1)


class PrecisionDebugger:
    def __init__(self, config_path: str = "./config.json", config: AgentConfig | None = None):
        self.config = config if config is not None else load_config(config_path)
        self.run_id = uuid.uuid4().hex[:16]
        self.current_step = 0
        self._mode: CaptureMode | None = None
        self._sender: Sender | None = None
        self._capturer: Capturer | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._npu_checked = False
        self._routed: dict[int, Sender] = {}   # server index -> sender, for collectives of other ranks' servers
        self._home = -1                         # this rank's own server index (-1: no routing)
        self._home_sender: Sender | None = None   # this rank's own server's sender, until every sender is closed
        self._routes_closed = False
        self._route_lock = threading.Lock()
        self._unwatched_step = -1               # the last step start() left unwatched (counted once)
        if not self.config.online_run_ut:
            log.warning("online check: tensor.online_run_ut is false in the config; nothing will be captured")
        atexit.register(self.close)

    # -- lazy start: the rank is known only once torch.distributed is initialised ---------------------------
    def _ensure_started(self) -> bool:
        if self._capturer is not None:
            return True
        if not self.config.online_run_ut or self._closed:
            return False
        rank, world = current_rank()
        self.rank, self.world_size = rank, world
        if self.config.ranks and rank not in self.config.ranks:  # this rank does not capture
            self._closed = True
            return False
        transport = self._make_transport(rank, world)
        if self.config.keep_freed_memory:
            freed_memory.keep_for_held(self.config.memory_bytes)
        self._sender = self._home_sender = Sender(transport, self.config.memory_bytes, self.config.policy)
        if not self.config.nfs_path and len(self.config.endpoints) > 1:
            self._home = rank % len(self.config.endpoints)
        backward = None
        if not self.config.recompute:
            from npu_agent import checkpoint
            from npu_agent.backward import BackwardTaps

            backward = BackwardTaps(self._sender.submit)
            checkpoint.install()
        cfg = self.config
        policy = Policy(cfg.sample_steps, cfg.sample_ranks, cfg.coverage_steps, cfg.overhead_budget)
        # the overhead budget charges the agent's CPU outside the training thread too (the senders' threads)
        sampler = Sampler(policy, rank, agent_cpu=self._agent_cpu if cfg.overhead_budget > 0 else None) \
            if policy.active else None
        if sampler is not None:   # the budget may leave steps unwatched only in a training of one process
            sampler.single_process = world == 1
        self._capturer = Capturer(self._route, cfg.api_list, cfg.scope, backward, sampler, ranks=cfg.ranks)
        self._sender.job = self._job()
        self._capturer.next_step(self.current_step)
        self._mode = CaptureMode(self._capturer)
        self._register_npu()
        log.info("online check: rank %d of %d capturing for run %s to %s", rank, world, self.run_id,
                 self.config.nfs_path or self.config.endpoint_for(rank).target)
        return True

    def _agent_cpu(self) -> tuple[float, int, int]:
        """(CPU seconds, records submitted, records sent) of this rank's senders so far: the overhead budget's
        charge for the agent's work outside the training thread (encoding, gRPC)."""
        cpu, submitted, done = 0.0, 0, 0
        for sender in (self._home_sender, *list(self._routed.values())):
            if sender is not None:
                cpu += sender.cpu_seconds()
                submitted += sender.counts.captured
                done += sender.records_done
        return cpu, submitted, done

    def _job(self) -> str:
        """The training's id shared by its ranks (npu_agent.collectives), "" before torch.distributed is set up."""
        try:
            import torch.distributed as dist

            if self._capturer is not None and dist.is_available() and dist.is_initialized():
                return self._capturer.collectives.job
        except Exception:  # noqa: BLE001
            log.debug("online check: no job id", exc_info=True)
        return ""

    def _route(self, rec: PendingRecord) -> bool:
        """The capturer's sink. A collective's records go to the server of its lowest member rank, so that one
        server has all of them; a second sender (same run and rank) to that server opens at its first record."""
        home = self._home_sender
        coll = rec.collective
        if coll is not None and self._home >= 0:
            index = self.config.server_index_for_collective(coll.ranks)
            if index is not None and index != self._home:
                routed = self._routed.get(index) or self._open_route(index)
                if routed is not None:
                    return routed.submit(rec)
        return home.submit(rec) if home is not None else False

    def _open_route(self, index: int) -> Sender | None:
        with self._route_lock:
            if index in self._routed:
                return self._routed[index]
            if self._routes_closed:
                return None
            from npu_agent.transport_grpc import GrpcTransport

            cfg = self.config
            transport = GrpcTransport(cfg.endpoints[index], cfg.tls_path, self.run_id, self.rank, self.world_size,
                                      cfg.connect_timeout_s, cfg.max_retry_s)
            sender = Sender(transport, cfg.memory_bytes, cfg.policy)
            sender.job = self._job()
            self._routed[index] = sender
            log.info("online check: rank %d sends the collectives of groups led by other servers' ranks to %s",
                     self.rank, cfg.endpoints[index].target)
            return sender

    def _make_transport(self, rank: int, world: int) -> Transport:
        cfg = self.config
        if cfg.nfs_path:
            from npu_agent.transport_folder import FolderTransport

            return FolderTransport(cfg.nfs_path, self.run_id, rank, world, max_retry_s=cfg.max_retry_s,
                                   connect_timeout_s=cfg.connect_timeout_s)
        from npu_agent.transport_grpc import GrpcTransport

        return GrpcTransport(cfg.endpoint_for(rank), cfg.tls_path, self.run_id, rank, world,
                             cfg.connect_timeout_s, cfg.max_retry_s)

    def _register_npu(self) -> None:
        if self._npu_checked:
            return
        self._npu_checked = True
        try:
            import torch_npu  # noqa: F401 - present only on Ascend hosts
        except ImportError:
            return
        from npu_agent.naming import register_npu_namespace

        log.info("online check: torch_npu present; %d npu_* functions captured as NPU APIs",
                 register_npu_namespace(torch_npu))

    # -- the training loop API -----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if not self._ensure_started() or self._mode is None:
                return
            if self._sender is not None and self._sender.refusal is not None:
                return   # the server can never accept this agent (logged once): capture nothing more
            if self.config.steps and self.current_step not in self.config.steps:
                return
            if self._mode in function_mode_stack():
                return
            sampler = self._capturer.sampler if self._capturer is not None else None
            if sampler is not None and not sampler.watched:
                # nothing known to capture in this step (npu_agent.sampling, "Steps the agent does not watch"):
                # the training runs without the mode, as between stop() and start()
                if self._unwatched_step != self.current_step:
                    self._unwatched_step = self.current_step
                    sampler.unwatched()
                return
            self._mode.__enter__()
            try:   # the module stack, followed only while capture is on
                location.install()
            except Exception:  # noqa: BLE001 - never raise into the training; records go out without a module
                log.debug("online check: installing the module hooks failed", exc_info=True)

    def stop(self) -> None:
        with self._lock:
            mode = self._mode
            if mode is None:
                return
            if self._unwatched_step == self.current_step:   # start() did not push the mode in this step
                return
            stack = function_mode_stack()
            if stack and stack[-1] is mode:
                mode.__exit__(None, None, None)
            elif mode in stack:
                log.warning("online check: stop() called while another TorchFunctionMode is active above ours; "
                            "capture stops when that mode exits")
            location.uninstall()
            if self._capturer is not None:   # async collectives never waited on go out unfinished
                self._capturer.flush_collectives()
            try:   # what the training does next is not seen by the mode: unsent references get their copies
                HELD.protect_all()
            except Exception:  # noqa: BLE001 - never raise into the training; such a record goes out SKIP
                log.debug("online check: copying held tensors at stop() failed", exc_info=True)

    def step(self) -> None:
        self.current_step += 1
        if self._capturer is not None:
            self._capturer.release_regions()
            if self._capturer.backward is not None:
                self._capturer.backward.end_step()
            self._capturer.next_step(self.current_step)

    def close(self) -> dict[str, Any] | None:
        """Flush: wait for the server to acknowledge everything (bounded by online_close_timeout_s, and by
        online_connect_timeout_s when no server was ever reached; not at all after a refusal), send the
        end-of-stream message with the counts, and log them. Idempotent; also runs at interpreter exit."""
        with self._lock:
            if self._closed and self._sender is None:
                return None
            self._closed = True
            sender, self._sender = self._sender, None
        if sender is None:
            return None
        self.stop()
        if self._capturer is not None:
            self._capturer.release_regions()
            if self._capturer.backward is not None:
                self._capturer.backward.end_step()
        sampler = self._capturer.sampler if self._capturer else None
        if sampler is not None:   # Counts' attributes are the counts the end-of-stream message carries
            sender.counts.sampling = sampler.report()
        sender.job = self._job() or sender.job
        counts = sender.close(self.config.close_timeout_s)
        with self._route_lock:
            routed, self._routed, self._routes_closed = list(self._routed.values()), {}, True
        self._home_sender = None
        for extra in routed:   # the senders to other servers (collectives routed there): each sends its own End
            extra.job = sender.job
            more = extra.close(self.config.close_timeout_s)
            for key in ("captured", "sent", "acknowledged", "rejected", "dropped", "duplicates", "unacknowledged"):
                counts[key] += more[key]
            counts["server_reached"] = counts["server_reached"] and more["server_reached"]
        counts["servers"] = 1 + len(routed)
        counts["forward_calls"] = self._capturer.captured if self._capturer else 0
        counts["internal_errors"] = self._capturer.errors if self._capturer else 0
        if sampler is not None:
            sampling = counts["sampling"]
            log.info("online check: rank %d sampling: %d of %d calls captured (%d of %d distinct call sites, each "
                     "captured at its first call the budget allowed); skipped: %d in steps not sampled, %d in other "
                     "ranks' turns, %d "
                     "repeats of call sites checked within %d steps, %d in %d steps skipped for the overhead budget "
                     "of %g",
                     self.rank, sampling["captured"], sampling["calls"], sampling["new_call_sites"],
                     sampling["call_sites"],
                     sampling["skipped_steps"], sampling["skipped_ranks"], sampling["skipped_repeats"],
                     self.config.coverage_steps, sampling["skipped_budget"], sampling["steps_skipped_budget"],
                     self.config.overhead_budget)
        lost = counts["unacknowledged"]
        log.info("online check: run %s rank %d: captured %d, sent %d, acknowledged %d, rejected %d, dropped %d, "
                 "unacknowledged %d", self.run_id, self.rank, counts["captured"], counts["sent"],
                 counts["acknowledged"], counts["rejected"], counts["dropped"], lost)
        if lost and not counts["server_reached"]:
            log.warning("online check: %d records are lost: no server was reached within "
                        "tensor.online_connect_timeout_s (%.0f s); %s", lost, self.config.connect_timeout_s,
                        sender.transport.describe_state())
        elif lost:
            log.warning("online check: %d records were never acknowledged within %.0f s and are lost; raise "
                        "tensor.online_close_timeout_s or check the server", lost, self.config.close_timeout_s)
        return counts
