"""parwatch's vocabulary: every closed set of names the code compares against, defined once.

Standard library only, so every layer imports it (the contract, the trainer, the collector, the
sidecar, report/). Each set is a `StrEnum`: a member equals its string and hashes the same, so the
wire, the JSONL files and the rule files keep their plain names; code writes `Action.PAUSE`, never
`"pause"` (tests/unit/test_vocabulary.py fails on a comparison against a member's string elsewhere).

The schedule registry (`SCHEDULES`, `schedule()`) is the one list of pipeline schedules: the
reference trainer, the torch.distributed.pipelining integration, the bubble theory and the example
all read it. `jsonable` is the one way NaN and inf are written (the strings "nan", "inf", "-inf").
The rank layout (rank <-> tp_rank, stage, dp_rank, in the run's order) is parwatch.rank_layout.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: what 3.11's StrEnum does for these uses

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

# --- directives and what ranks did with them -----------------------------------------------------


class Action(StrEnum):
    """What a directive asks. The value is the wire name; `code` the boundary slot value."""

    PAUSE = "pause"
    RESUME = "resume"
    ROLLBACK = "rollback"

    @property
    def code(self) -> int:
        return _ACTION_CODES[self]

    @classmethod
    def from_code(cls, code: int) -> Action | None:
        return _CODE_ACTIONS.get(code)


_ACTION_CODES = {Action.PAUSE: 1, Action.RESUME: 2, Action.ROLLBACK: 3}
_CODE_ACTIONS = {v: k for k, v in _ACTION_CODES.items()}


class Outcome(StrEnum):
    """What ranks did with a directive: each rank's, counted in the step-boundary vector
    (parwatch.contract.boundary), and the run's, in rank 0's outcome record and the decision log."""

    APPLIED = "applied"
    """Done as asked."""
    SUBSTITUTED = "substituted"
    """A rollback that loaded another checkpoint than asked (the asked one failed verification)."""
    FAILED = "failed"
    """Not done; FailReason says why (the run goes on as it was)."""
    IGNORED = "ignored"
    """Not for this run (another run id): never applied."""
    MIXED = "mixed"
    """The run's ranks differ (counts say how); never one rank's."""


class FailReason(StrEnum):
    """Why a rank failed or ignored a directive."""

    NO_CHECKPOINT = "no_checkpoint"
    """No complete checkpoint to roll back to (none saved, or no checkpoint dir)."""
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    """Every candidate checkpoint failed its sha256 check on some rank."""
    LOAD_ERROR = "load_error"
    """Loading a verified checkpoint raised (shape or layout mismatch, I/O error)."""
    OTHER_RUN = "other_run"
    """The directive names another run id."""


class RecordType(StrEnum):
    """The `type` of a decisions.jsonl record that is no outcome (an outcome's type is its Outcome)."""

    DECISION = "decision"
    CANCELLED = "cancelled"
    DELIVERED = "delivered"


class DirectiveState(StrEnum):
    """Where a directive is: created by a decision, or handed to rank 0."""

    CREATED = "created"
    DELIVERED = "delivered"


# --- guardrail rules and decisions ----------------------------------------------------------------


class RuleAction(StrEnum):
    """What a rule does when it fires: alert only, a directive, or requeue the Slurm job."""

    ALERT = "alert"
    PAUSE = "pause"
    ROLLBACK = "rollback"
    REQUEUE = "requeue"
    """Not a directive: the leader sidecar itself runs `scontrol requeue JOB` (parwatch/sidecar/requeue.py);
    the job restarts with its id and resumes from its newest verified checkpoint. Only under Slurm."""


class RuleState(StrEnum):
    OK = "ok"
    PENDING = "pending"
    """Failing, not yet for its for_steps / for_seconds."""
    FIRING = "firing"


class CheckKind(StrEnum):
    THRESHOLD = "threshold"
    FINITE = "finite"
    SPIKE = "spike"
    """Against the series' own rolling baseline."""
    REGRESSION = "regression"
    """Against a baseline frozen from a reference window."""


class Reduce(StrEnum):
    """How a rule reduces a metric's series (ranks, stages) to one number."""

    MAX = "max"
    MIN = "min"
    MEAN = "mean"


class Comparison(StrEnum):
    """Which side of a threshold fails."""

    ABOVE = "above"
    BELOW = "below"


class DecisionSource(StrEnum):
    """Who made a decision."""

    RULE = "rule"
    OPERATOR = "operator"
    ALERTMANAGER = "alertmanager"
    ENGINE = "engine"
    """The engine itself (e.g. escalating a failed rollback)."""
    RANK0 = "rank0"
    """Rank 0's local guard (a non-finite loss seen before the sidecar's view)."""
    STEP_CHECK = "step_check"
    """Every rank together, before the optimizer step (parwatch.contract.step_check); the leader records it."""


class BuiltinRule(StrEnum):
    """The rules parwatch judges itself (no rules file names them): a decision's `rule`."""

    HANG = "hang"
    """The leader's hang monitor (parwatch/sidecar/hang.py): no step boundary past the hang bound."""
    RANK_GONE = "rank-gone"
    """The hang monitor: a rank's process ended (crashed, killed)."""
    SIDECAR_LOST = "sidecar-lost"
    """The hang monitor: a node's sidecar sent no digest while the run crossed step boundaries."""
    NONFINITE_LOSS = "nonfinite-loss"
    """Rank 0's local guard (parwatch/collector/fallback.py) while its sidecar was unreachable."""


# --- the check before the optimizer step (parwatch.contract.step_check) -----------------------------


class StepFault(StrEnum):
    """What the check before the optimizer step found; the value names the decision's rule."""

    NONFINITE = "step-nonfinite"
    """A rank's loss or gradients are NaN or infinite."""
    SPIKE = "step-spike"
    """The step's loss is above factor x the median of the previous applied steps' losses."""


class StepAction(StrEnum):
    """What every rank did with a step the check found bad."""

    RERUN = "rerun"
    """Forward and backward again on the same microbatches; the re-run passed, its update went in."""
    SKIP = "skip"
    """No update: the gradients zeroed, the batch passed over."""
    PAUSE = "pause"
    """Skipped, and the run holds after the step's boundary (skips kept coming)."""


class Triage(StrEnum):
    """What kind of fault a bad step was, told by re-running it on the same microbatches."""

    TRANSIENT = "transient"
    """The re-run passed: a fault of the moment (a flaky device, silent data corruption) on the named rank."""
    PERSISTENT = "persistent"
    """Non-finite again on the same microbatches: the batch, or the weights, reproduce it."""
    DATA_CAUSED = "data-caused"
    """A finite loss spike the re-run reproduces: the microbatches themselves give it."""
    UNTRIAGED = "untriaged"
    """Not re-run (the trainer gave the check no way to): skipped without telling the kind."""


# --- ranks' activity -----------------------------------------------------------------------------


class RankState(StrEnum):
    """A rank's live state: what it reports (running, done, crashed), what its node adds (gone,
    silent), what the leader adds (unknown: never or no longer heard), and HUNG, the metric's."""

    RUNNING = "running"
    DONE = "done"
    CRASHED = "crashed"
    GONE = "gone"
    SILENT = "silent"
    UNKNOWN = "unknown"
    HUNG = "hung"


class SidecarRole(StrEnum):
    LEADER = "leader"
    NODE = "node"


class Speaker(StrEnum):
    """Who a request's credential speaks for (parwatch/credentials.py)."""

    OPERATOR = "operator"  # the shared token: operators, Alertmanager, node sidecars, tooling
    RANK = "rank"  # one rank of one run: its summaries and its activity
    NODE = "node"  # one node sidecar: its digests and cross-node instances


# --- parallelism and communication ---------------------------------------------------------------


class GroupRole(StrEnum):
    """The process groups a collective may name (the `group` label)."""

    TP = "tp"
    PP = "pp"
    DP = "dp"
    WORLD = "world"
    """The step boundary's all-reduce."""
    EP = "ep"
    CP = "cp"


class CollectiveOp(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"


class P2PPayload(StrEnum):
    """What a pipeline send/recv carries (a span's `what`)."""

    ACTIVATION = "activation"
    GRAD = "grad"


# --- spans, events, boundaries (the contract re-exports these) -----------------------------------


class SpanKind(StrEnum):
    """What a span measures."""

    FORWARD = "forward"
    BACKWARD = "backward"
    """A full backward (input and weight gradients together)."""
    BACKWARD_INPUT = "backward_input"
    """Zero-bubble schedules: the input-gradient half (I)."""
    BACKWARD_WEIGHT = "backward_weight"
    """Zero-bubble schedules: the weight-gradient half (W)."""
    LOSS = "loss"
    """The loss computed outside the last stage's forward (torch pipelining)."""
    SEND = "send"
    RECV = "recv"
    COLLECTIVE = "collective"
    OPTIMIZER = "optimizer"
    DP_SYNC = "dp_sync"
    """Data-parallel gradient sync, and gradient scaling after the last backward."""
    CHECKPOINT = "checkpoint"
    DATA = "data"
    """Fetching the next batch (data loading)."""
    BOUNDARY = "boundary"
    """The step-boundary all-reduce: mostly the wait for the pipeline's flush."""
    EVAL = "eval"
    """An evaluation the trainer runs between training steps (not a training step's work)."""


class HangKind(StrEnum):
    """What a hang's culprit is stuck in (parwatch.sidecar.hang.hang_kind)."""

    HOST = "host"
    """Its host thread is in its own work (compute, data, a checkpoint, between spans)."""
    PEER = "peer"
    """It waits for ranks that are not in the operation with it."""
    TRANSPORT = "transport"
    """Every member entered the collective (or both ends of the send and receive): the bytes do not move."""
    DEVICE = "device"
    """CUDA: its device stayed on one span's work while its host waits."""


class TimeCategory(StrEnum):
    """Where a second of a rank's wall time went: the goodput ledger (docs/goodput.md). Every second
    from process start to exit lands in exactly one."""

    PRODUCTIVE = "productive"
    """Forward, backward (input, weight) and loss of training steps that still count."""
    BUBBLE_SCHEDULE = "bubble_schedule"
    """Pipeline idle the schedule implies."""
    BUBBLE_IMBALANCE = "bubble_imbalance"
    """Pipeline idle that unequal stage times add."""
    BUBBLE_WAIT = "bubble_wait"
    """The rest of the pipeline idle: late transfers, stalls, the host."""
    EXPOSED_COMM = "exposed_comm"
    """TP and DP collectives the rank waited in (not overlapped with compute)."""
    OPTIMIZER = "optimizer"
    DATA_WAIT = "data_wait"
    """Blocking on the next batch."""
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_LOAD = "checkpoint_load"
    """Loading a checkpoint for a rollback (the gap until training resumes)."""
    STARTUP = "startup"
    """Process start to the run's first step boundary."""
    PAUSED = "paused"
    """Held by a pause directive (a guardrail's or an operator's)."""
    WASTED = "wasted"
    """Productive time of steps a rollback discarded (moved out of productive when it is applied)."""
    DOWN = "down"
    """A rank's process absent between a crash and its restart under the same run id (the sidecar's)."""
    EVAL = "eval"
    UNATTRIBUTED = "unattributed"
    """What no span or gap explains (host work between spans, shutdown)."""


class BubbleCause(StrEnum):
    """What a stage's pipeline bubble is split into (parwatch.pipeline_sim.bubble_causes): a global view
    stage's `bubble_<cause>_ratio`, exported as parwatch_stage_bubble_<cause>_ratio, and the ledger's
    `bubble_<cause>` seconds."""

    SCHEDULE = "schedule"
    """What the schedule itself implies with every stage at the step's mean per-action times."""
    IMBALANCE = "imbalance"
    """What this step's unequal stage times add."""
    WAIT = "wait"
    """The rest of the measured bubble: p2p, collectives, the host."""

    @property
    def ratio_field(self) -> str:
        return f"bubble_{self.value}_ratio"

    @property
    def metric(self) -> str:
        return f"parwatch_stage_{self.ratio_field}"

    @property
    def time_category(self) -> TimeCategory:
        return TimeCategory(f"bubble_{self.value}")


OUTSIDE_TRAINING: tuple[TimeCategory, ...] = (
    TimeCategory.STARTUP,
    TimeCategory.CHECKPOINT_SAVE,
    TimeCategory.CHECKPOINT_LOAD,
    TimeCategory.PAUSED,
    TimeCategory.WASTED,
    TimeCategory.DOWN,
    TimeCategory.EVAL,
    TimeCategory.UNATTRIBUTED,
)
"""What ETTR counts as not training: everything but the training steps that count (docs/goodput.md)."""


class Event(StrEnum):
    """Rare events, with their attrs."""

    RUN_START = "run_start"
    """config (dict), rank, model_flops_per_step (int | None), pipeline_order (see parwatch.pipeline_sim)."""
    CHECKPOINT_SAVED = "checkpoint_saved"
    """step; checkpoints: every complete, verified step on disk now."""
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    """step, reason (the loss was not finite)."""
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    """step, rank, error: a shard failed verification; checkpoints: the steps still usable."""
    DIRECTIVE_APPLIED = "directive_applied"
    """id, action, step, outcome (Outcome name), loaded_step, reason."""
    PAUSED = "paused"
    """step."""
    ROLLBACK = "rollback"
    """from_step, to_step, skip_batches: a new timeline begins."""
    RESTORED = "restored"
    """step: a restarted run loaded this checkpoint before its first step (its resume boundary follows)."""
    RUN_END = "run_end"
    """steps_completed, summary (dict; observers may add to it)."""
    STEP_RERUN = "step_rerun"
    """step: the check before the optimizer found the step bad; its forward and backward run again now
    (what ran since the step began is discarded)."""
    STEP_CHECKED = "step_checked"
    """step, verdict (parwatch.contract.step_check.Verdict.as_dict()): what every rank did with a bad step
    (a skip discards all of the step's work)."""


class BoundaryKind(StrEnum):
    START = "start"
    """Before the first step (step 0)."""
    STEP = "step"
    """After a step; the step number is the step just finished."""
    HEARTBEAT = "heartbeat"
    """While paused: the step repeats, nothing is accounted."""
    RESUME = "resume"
    """After a pause or a rollback: a new period begins."""


class InstrOp(StrEnum):
    """The reference trainer's pipeline instructions (parwatch.trainer.schedules)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECV_ACT = "recv_act"
    RECV_GRAD = "recv_grad"
    SEND_ACT = "send_act"
    SEND_GRAD = "send_grad"


# --- metrics -------------------------------------------------------------------------------------


class MetricKind(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    INFO = "info"


class SelfPart(StrEnum):
    """Where parwatch's own time on a rank goes (parwatch_self_seconds_total{part})."""

    HOOKS = "hooks"
    """Span enter and exit on the training thread (the contract's registry and the integrations' wrappers)."""
    COLLECTOR = "collector"
    """The collector's step-boundary work on the training thread: folding the step's spans, the summary."""
    SHIPPER = "shipper"
    """The shipper thread's CPU: encoding, posting and writing summaries, rank 0's bubble-cause replay."""
    ACTIVITY = "activity"
    """The activity reporter thread's CPU (liveness for hang detection)."""


class Tracker(StrEnum):
    """Experiment trackers the leader sidecar can write to (`parwatch sidecar --export`)."""

    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"


# --- pipeline schedules --------------------------------------------------------------------------


class ScheduleName(StrEnum):
    """parwatch's name of a pipeline schedule (a summary's `schedule`)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved1f1b"
    LOOPED_BFS = "loopedbfs"
    INTERLEAVED_ZB = "interleavedzb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


@dataclass(frozen=True)
class Schedule:
    name: ScheduleName
    torch_class: str | None
    """torch.distributed.pipelining's class name, or None when torch has none."""
    closed_form: bool
    """Its bubble at uniform stages is (p-1)/(v*m+p-1); else the theory is its replay (parwatch.bubble)."""
    chunks: tuple[int, ...] | None
    """Allowed chunks (v, model chunks per stage); None: any v >= 1."""
    default_chunks: int
    reference: bool
    """The reference trainer (parwatch.trainer) runs it."""
    v_shape: bool = False
    """Stage indices run in a V: rank r holds stages r and 2p-1-r (else r, r+p, r+2p, ...)."""
    aliases: tuple[str, ...] = ()
    """Other names users type or older summaries carry."""

    @property
    def one_chunk(self) -> bool:
        """One model chunk per stage: torch builds it on one stage (GPipe, 1F1B)."""
        return self.chunks == (1,)


SCHEDULES: dict[str, Schedule] = {  # keyed by ScheduleName (a str)
    s.name: s
    for s in (
        Schedule(ScheduleName.GPIPE, "ScheduleGPipe", True, (1,), 1, reference=True),
        Schedule(ScheduleName.ONE_F_ONE_B, "Schedule1F1B", True, (1,), 1, reference=True),
        Schedule(
            ScheduleName.INTERLEAVED_1F1B,
            "ScheduleInterleaved1F1B",
            True,
            None,
            2,
            reference=True,
            aliases=("interleaved",),
        ),
        Schedule(ScheduleName.LOOPED_BFS, "ScheduleLoopedBFS", True, None, 2, reference=False),
        Schedule(ScheduleName.INTERLEAVED_ZB, "ScheduleInterleavedZeroBubble", False, None, 2, reference=False),
        Schedule(ScheduleName.ZBV, "ScheduleZBVZeroBubble", False, (2,), 2, reference=False, v_shape=True),
        Schedule(ScheduleName.DUALPIPEV, "ScheduleDualPipeV", False, (2,), 2, reference=False, v_shape=True),
    )
}
REFERENCE_SCHEDULES = tuple(s.name for s in SCHEDULES.values() if s.reference)
"""What the reference trainer runs (its --schedule choices, besides the aliases)."""


def schedule_key(name: str) -> str:
    """ScheduleInterleaved1F1B, interleaved-1f1b -> interleaved1f1b."""
    return name.lower().replace("schedule", "").replace("_", "").replace("-", "")


_BY_KEY = {schedule_key(k): s for s in SCHEDULES.values() for k in (s.name, *s.aliases, s.torch_class or s.name)}


def schedule(name: str) -> Schedule | None:
    """The registry entry a name means: its name, an alias, or its torch class name, in any case and
    with or without separators ("interleaved", "ScheduleInterleaved1F1B"); None if none."""
    return _BY_KEY.get(schedule_key(name))


def canonical_schedule(name: str) -> str:
    """The registry's name for `name`, or `name` itself when the registry does not know it."""
    entry = schedule(name)
    return entry.name.value if entry is not None else name


# --- the numbers JSON has no words for -----------------------------------------------------------


def jsonable(value: Any) -> Any:
    """`value` as strict JSON (allow_nan=False) takes it: NaN and inf at any depth become the wire's
    strings "nan", "inf", "-inf" (float() reads them back), and tuples lists."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
