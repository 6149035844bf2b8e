"""TrainConfig (flags, validation messages) and ParallelDims (rank layout, groups)."""

import itertools

import pytest

from parwatch.rank_layout import Coords
from parwatch.trainer.config import TrainConfig, build_parser, parse_args
from parwatch.trainer.errors import ConfigError
from parwatch.trainer.parallel_dims import ParallelDims

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 4, 1), (2, 2, 1), (2, 2, 2), (4, 2, 3), (3, 1, 2)]


# ---------------------------------------------------------------- ParallelDims
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_coords_and_rank_of_round_trip(tp, pp, dp):
    dims = ParallelDims(tp, pp, dp, tp * pp * dp)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert (0 <= c.tp_rank < tp, 0 <= c.stage < pp, 0 <= c.dp_rank < dp) == (True, True, True)
        assert dims.layout.rank_of(c.tp_rank, c.stage, c.dp_rank) == rank
        seen.add(c)
    assert len(seen) == dims.world_size  # a bijection between ranks and coordinates


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_every_rank_is_in_exactly_one_group_per_role(tp, pp, dp):
    dims = ParallelDims(tp, pp, dp, tp * pp * dp)
    for groups, size in ((dims.tp_group_ranks(), tp), (dims.pp_group_ranks(), pp), (dims.dp_group_ranks(), dp)):
        assert all(len(g) == size for g in groups)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(dims.world_size))


def test_tp_ranks_are_adjacent_pp_next_dp_outermost():
    dims = ParallelDims(tp=2, pp=2, dp=2, world_size=8)
    assert dims.tp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.pp_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.dp_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coords(6) == Coords(tp_rank=0, stage=1, dp_rank=1)


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_group_members_share_all_other_coordinates(tp, pp, dp):
    dims = ParallelDims(tp, pp, dp, tp * pp * dp)
    for role, groups in (("tp", dims.tp_group_ranks()), ("pp", dims.pp_group_ranks()), ("dp", dims.dp_group_ranks())):
        for group in groups:
            coords = [dims.coords(r) for r in group]
            field = {"tp": "tp_rank", "pp": "stage", "dp": "dp_rank"}[role]
            others = {c._replace(**{field: 0}) for c in coords}
            assert len(others) == 1, f"{role} group {group} mixes other coordinates"
            assert [getattr(c, field) for c in coords] == list(range(len(group)))


@pytest.mark.parametrize(
    "tp,pp,dp,world,fix",
    [
        (2, 2, 1, 2, "use --pp 1 or --nproc 4"),
        (2, 3, 1, 4, "use --pp 2 or --nproc 6"),
        (3, 1, 1, 4, "use --nproc 3"),
    ],
)
def test_world_size_mismatch_names_the_product_and_the_fix(tp, pp, dp, world, fix):
    with pytest.raises(ConfigError) as err:
        ParallelDims(tp, pp, dp, world)
    message = str(err.value)
    assert f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}" in message
    assert f"world size {world}" in message and fix in message


@pytest.mark.parametrize("field", ["tp", "pp", "dp"])
def test_non_positive_degree_is_named(field):
    values = dict(tp=1, pp=1, dp=1, world_size=1)
    values[field] = 0
    with pytest.raises(ConfigError, match=f"{field}=0 must be a positive integer"):
        ParallelDims(**values)


# ------------------------------------------------------------------ TrainConfig
def test_defaults_validate():
    TrainConfig().validate()
    TrainConfig().validate(world_size=1)


@pytest.mark.parametrize(
    "changes,world,expected",
    [
        (dict(schedule="zigzag"), None, "--schedule='zigzag' is unknown; choose one of gpipe, 1f1b, interleaved"),
        (dict(tp=0), None, "--tp=0 must be at least 1"),
        (dict(micro_batch_size=0), None, "--micro-batch-size=0 must be at least 1"),
        (dict(seq_len=0), None, "--seq-len=0 must be at least 1"),
        (dict(microbatches=0), None, "--microbatches=0 must be at least 1"),
        (dict(tp=3), None, "--heads=4 is not divisible by --tp=3; choose tp in [1, 2, 4]"),
        (dict(hidden=66), None, "--hidden=66 is not divisible by --heads=4; choose a multiple of 4"),
        (dict(tp=4, heads=4, vocab=66), None, "--vocab=66 is not divisible by --tp=4; choose a multiple of 4"),
        (dict(pp=4, layers=2), None, "--layers=2 is fewer than pp*chunks=4 pipeline chunks; raise --layers to 4"),
        (dict(pp=2, layers=3, schedule="interleaved", chunks=2), None, "raise --layers to 4 or lower --pp"),
        (dict(optimizer="lion"), None, "--optimizer='lion'; choose adamw or sgd"),
        (dict(dtype="bfloat16"), None, "--dtype='bfloat16'; choose float32 or float64"),
        (dict(checkpoint_every=5), None, "--checkpoint-every needs --checkpoint-dir DIR"),
        (dict(resume=True), None, "--resume loads a checkpoint: give --checkpoint-dir"),
        (dict(parwatch="maybe"), None, "--parwatch='maybe'; choose on, off or auto"),
        (
            dict(parwatch="off", parwatch_endpoint="http://127.0.0.1:9401"),
            None,
            "--parwatch-endpoint is given but --parwatch=off watches nothing",
        ),
        (dict(parwatch="off", parwatch_log="run"), None, "--parwatch-log is given but --parwatch=off"),
        (dict(inject=["nan:step=x"]), None, "--inject 'nan:step=x': step='x' is not a int"),
        (dict(inject=["slow-collective:group=world,ms=1"]), None, "group must be tp, pp or dp"),
        (dict(synthetic_compute="fwd_ms=-1,bwd_ms=2"), None, ">= 0"),
        (dict(chunks=2), None, "chunks=2 needs schedule='interleaved1f1b'"),
        (
            dict(pp=2, schedule="interleaved", chunks=2, microbatches=3),
            None,
            "microbatches=3 is not a multiple of num_stages=2 (interleaved needs it, as in Megatron); use microbatches=2 or 4",
        ),
        (dict(tp=2), 4, "tp*pp*dp = 2*1*1 = 2 does not equal the world size 4; use --pp 2 or --nproc 2"),
    ],
)
def test_validate_names_the_setting_and_the_fix(changes, world, expected):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**changes).validate(world)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "changes,setting",
    [
        # Settings validate() does not check today (see the report): each fails later, inside
        # every rank (partition, backend) or after training for a while (checkpoints).
        (dict(partition="even"), "--partition"),
        (dict(keep_checkpoints=-1, checkpoint_dir="/tmp/x"), "--keep-checkpoints"),
        (dict(checkpoint_every=-3, checkpoint_dir="/tmp/x"), "--checkpoint-every"),
        (dict(backend="mpi2"), "--backend"),
    ],
    ids=["partition", "keep-checkpoints", "checkpoint-every", "backend"],
)
def test_validate_rejects_settings_that_would_fail_later(changes, setting):
    with pytest.raises(ConfigError, match=setting):
        TrainConfig(**changes).validate(1)


def test_every_field_is_a_flag_and_parses_back():
    cfg = parse_args(
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--micro-batch-size",
            "3",
            "--lr",
            "0.01",
            "--dtype",
            "float64",
            "--inject",
            "nan:step=2",
            "--inject",
            "crash:rank=1,step=3",
        ]
    )
    assert (cfg.tp, cfg.pp, cfg.micro_batch_size, cfg.lr, cfg.dtype) == (2, 2, 3, 0.01, "float64")
    assert cfg.inject == ["nan:step=2", "crash:rank=1,step=3"]
    flags = {a.dest for a in build_parser()._actions} - {"help"}
    assert flags == set(TrainConfig().to_dict())


def test_tokens_per_step_counts_every_replica():
    assert TrainConfig(dp=2, microbatches=3, micro_batch_size=4, seq_len=8).tokens_per_step == 2 * 3 * 4 * 8


def test_the_launcher_parses_and_validates_without_importing_torch():
    """`parwatch train --nproc N`'s launcher only spawns the ranks: importing torch there would add
    about 2 s of CPU before the first rank starts and after the last one ends."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from parwatch.cli.train import train\n"
        "from parwatch.trainer.config import parse_args\n"
        "from parwatch.collector.attach import attach_from_config\n"
        "from parwatch.trainer.launch import main, spawn\n"
        "cfg = parse_args(['--nproc', '2', '--pp', '2', '--synthetic-compute', 'fwd_ms=1,bwd_ms=2',\n"
        "                  '--inject', 'nan:step=3', '--schedule', 'interleaved1f1b', '--chunks', '2'])\n"
        "cfg.validate(2)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "False", "the launcher imported torch"
