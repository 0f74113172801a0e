"""`accelerate launch --config_file YAML` under the launcher's guarantees: the two config files an
attendee would write (configs/accelerate/) load through Accelerate's own loader, each launched
trains exactly as `single` does, a failing rank is named and nothing is left running."""
import io
import textwrap
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import cli, processes_of
from harness import assert_same_as_single, single, train
from labsupport.accelerate_config import options
from labsupport.launch import RankFailed, launch

pytestmark = pytest.mark.multiprocess

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
YAML = {"accelerate-fsdp": CONFIGS / "fsdp.yaml", "accelerate-deepspeed": CONFIGS / "deepspeed.yaml"}


def test_config_files_load_through_accelerate_and_set_our_options():
    kinds = {strategy: load_config_from_file(str(path)).distributed_type.value for strategy, path in YAML.items()}
    assert kinds == {"accelerate-fsdp": "FSDP", "accelerate-deepspeed": "DEEPSPEED"}
    assert options(YAML["accelerate-fsdp"], 8) == {"strategy": "accelerate-fsdp", "nproc": 2, "zero": 3}
    assert options(YAML["accelerate-deepspeed"], 8) == {"strategy": "accelerate-deepspeed", "nproc": 2, "zero": 3,
                                                        "grad_clip": 1.0, "micro_batch": 4}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", YAML)
def test_accelerate_launch_of_each_config_matches_single(strategy):
    """FULL_SHARD and ZeRO-3, each started by `accelerate launch --config_file`, which put the file's
    settings in the ranks' environment: the same losses and gradient norms as `single`."""
    out = train(strategy, 2, "--accelerate-config", YAML[strategy])
    assert out["strategy"] == strategy and out["parallel"]["zero"] == 3
    command = (Path(out["run_dir"]) / "command.txt").read_text()
    assert f"labsupport.agent accelerate --config_file {YAML[strategy]}" in command
    assert_same_as_single(out, single(), params="whole")
    assert processes_of(out["run_dir"]) == []


def test_a_failing_rank_is_named_and_nothing_is_left(tmp_path):
    """The ranks see Accelerate's environment (the file's plugin); rank 1 raises, rank 0 would wait an hour."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, time, torch
        from labsupport import comm, init
        with init() as rt:
            assert os.environ["ACCELERATE_USE_FSDP"] == "true" and os.environ["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"
            if rt.rank == 1:
                raise ValueError("boom on purpose")
            comm.all_reduce(torch.ones(1))
            time.sleep(3600)
    """))
    with pytest.raises(RankFailed) as err:
        launch(str(job), nproc=2, timeout=240, run_dir=tmp_path / "run", out=io.StringIO(),
               accelerate_config=YAML["accelerate-fsdp"])
    assert str(err.value).splitlines()[0] == "rank 1 failed: ValueError: boom on purpose"
    assert processes_of(tmp_path / "run") == []


@pytest.mark.parametrize("change, flags, message", [
    ((), ["--strategy", "ddp"], "--strategy ddp, but"),
    (("mixed_precision: 'no'", "mixed_precision: bf16"), [], "mixed_precision bf16; the equivalence"),
    (("gradient_accumulation_steps: 1", "gradient_accumulation_steps: 3"), [],
     "gradient_accumulation_steps 3 x num_processes 2 does not divide --global-batch 8"),
])
def test_a_config_we_do_not_run_is_refused_before_start(tmp_path, change, flags, message):
    path = tmp_path / "mine.yaml"
    path.write_text(YAML["accelerate-deepspeed"].read_text().replace(*change or ("", "")))
    res = cli("train", "--accelerate-config", path, "--global-batch", "8", *flags)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
