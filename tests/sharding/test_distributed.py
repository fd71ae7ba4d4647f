"""``jaxkv launch``: one generate command as two local processes of a ``jax.distributed`` group
(4 CPU devices each, one ``data=2,model=4`` mesh over all 8) prints what one process prints
with the same mesh over its 8 devices; a failed or stuck group is stopped and the process
named. The coordinator binds 127.0.0.1 only; every launch has a timeout."""

import re

import pytest

from tests.sharding.test_cli_mesh import KV_WARNING, generate_argv, one_error_line, run, save_tiny_checkpoint

LAUNCH = ["launch", "--num-processes", "2", "--devices-per-process", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def test_two_processes_print_what_one_prints(checkpoint, capsys):
    mesh = ("--mesh", "data=2,model=4")
    code, one_process, err = run(capsys, generate_argv(checkpoint, *mesh))
    assert code == 0, err
    code, two_processes, err = run(capsys, [*LAUNCH, "--timeout", "300", "--", *generate_argv(checkpoint, *mesh)])
    assert code == 0, err
    assert two_processes == one_process and one_process.count("--- prompt") == 2
    assert "2 prompts" in err and err.count(KV_WARNING) == 1  # process 0's stderr only


def test_a_failed_process_is_named_with_its_error(checkpoint, capsys):
    code, out, err = run(
        capsys, [*LAUNCH, "--timeout", "120", "--", *generate_argv(checkpoint, "--max-new-tokens", "0")]
    )
    assert code == 1 and not out
    assert re.search(r"process [01] of 2 failed \(exit code 2\)", err) and "max_new_tokens" in err


def test_the_timeout_stops_every_process(checkpoint, capsys):
    code, out, err = run(capsys, [*LAUNCH, "--timeout", "0.5", "--", *generate_argv(checkpoint, "--mesh", "model=8")])
    assert code == 1 and not out
    assert "timed out after 0.5 s" in err
    assert "process 0 of 2 was still running, stopped" in err and "process 1 of 2 was still running, stopped" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(LAUNCH, "jaxkv launch runs a generate command"), ([*LAUNCH, "--", "chat"], "runs a generate command"),
     ([*LAUNCH, "--", "generate", "--process-id", "1"], "sets --process-id for each process"),
     (["launch", "--num-processes", "0", "--", "generate"], "--num-processes must be at least 1")],
)  # fmt: skip
def test_launch_usage_errors(capsys, argv, message):
    code, _, err = run(capsys, argv)
    assert code == 2 and message in one_error_line(err)
