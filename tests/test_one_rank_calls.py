"""A collective call made on one rank only (``if trainer.is_world_process_zero():
trainer.save_model()``, ``if rank == 0: export_hf(...)``): that rank raises an error naming the call
within ``collective_timeout``, and its peer ends too (exit code 1, its log naming the call), so no job
is left hanging. Ranks in different calls both raise, naming both. 2 gloo ranks, collective_timeout
2 s (8 s where the ranks train first: a loaded machine must not time out the training steps)."""

from harness import run_until_exit
from peft_trial_workers import alone

TIMEOUT = 2.0


def _run(tmp_path, case, timeout=TIMEOUT):
    got = run_until_exit(alone, 2, str(tmp_path), case, timeout, timeout=150, grace=20)
    logs = {r: (tmp_path / f"rank{r}.log").read_text() if (tmp_path / f"rank{r}.log").exists() else ""
            for r in range(2)}
    return got, logs


def _check_alone(tmp_path, got, logs, call, timeout=TIMEOUT):
    code0, report0 = got[0]
    code1, report1 = got[1]
    # rank 0: the error, raised out of the rank after collective_timeout (not the 600 s default, not never)
    ok, text = report0
    assert not ok and code0 == 1, got
    want = (f"CollectiveError: yashard: {call} is a collective: {call} was called on rank 0 of 2, and rank(s) 1 "
            f"did not call it within collective_timeout={timeout:g}s. Call it on every rank, not only on rank 0 "
            "(not inside `if trainer.is_world_process_zero():`")
    assert want in text, text
    assert timeout <= float((tmp_path / "rank0.seconds").read_text()) < timeout + 15
    # rank 1: ended by its watchdog, its log naming the call
    assert code1 == 1 and report1 is None, got
    assert f"yashard: ending rank 1: {call} was called on rank 0 of 2, and rank(s) 1 did not call it" in logs[1], logs


def test_export_hf_on_rank_zero_alone_ends_both_ranks(tmp_path):
    got, logs = _run(tmp_path, "export")
    _check_alone(tmp_path, got, logs, "export_hf")
    assert not (tmp_path / "model").exists()


def test_trainer_save_model_inside_is_world_process_zero_ends_both_ranks(tmp_path):
    got, logs = _run(tmp_path, "trainer", 8.0)
    _check_alone(tmp_path, got, logs, "export_hf", 8.0)


def test_ranks_in_different_calls_both_raise_naming_both(tmp_path):
    got, _ = _run(tmp_path, "mismatch")
    for r in range(2):
        code, (ok, (text, seconds)) = got[r][0], got[r][1]
        assert ok and seconds < TIMEOUT, (r, text, seconds)  # at once: both arrived
        assert text == ("CollectiveError: yashard: the ranks entered different collective calls (rank 0: "
                        "save_checkpoint, rank 1: full_state_dict); every rank must make the same yashard calls in "
                        "the same order (export_hf, save_checkpoint, load_checkpoint, full_state_dict, save_adapter "
                        "are collectives)"), text
