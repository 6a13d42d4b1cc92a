"""``python -m yashard.plan`` turns a bad config into a usage error: exit code 2 and one line that
names the flag and the fix, no traceback."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, message", [
    (["--checkpoint-layers", "1000"], "--checkpoint-layers 1000: the model has 32 decoder layers; use a value between 0 "
                                      "and 32"),
    (["--shard-group-size", "3"], "--shard-group-size=3 does not divide the world size 8; use a divisor of 8"),
    (["--shard-group-size", "8", "--secondary-group-size", "3"], "--secondary-group-size=3 does not divide"),
    (["--secondary-group-size", "2", "--no-reshard"], "drop --secondary-group-size"),
    (["--param-dtype", "bf16", "--reduce-dtype", "fp16"], "--reduce-dtype=float16 cannot carry gradients"),
    (["--world", "0"], "--world 0: the number of data-parallel ranks, use 1 or more"),
])
def test_a_bad_config_is_a_usage_error(args, message, capsys):
    from yashard.plan.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--config", "llama-3-8b", "--world", "8", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) > len(message)


def test_an_unreadable_config_is_a_usage_error(tmp_path, capsys):
    from yashard.plan.__main__ import main

    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path), "--world", "8"])
    assert e.value.code == 2 and f"--config {tmp_path}: " in capsys.readouterr().err


def test_a_family_the_activation_estimate_cannot_model_is_a_usage_error(tmp_path, capsys):
    from models import tiny_config
    from yashard.plan.__main__ import main

    tiny_config("gemma2").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path), "--world", "2"])
    assert e.value.code == 2 and "not model_type='gemma2'" in capsys.readouterr().err


def test_the_process_exits_2_with_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-m", "yashard.plan", "--config", "llama-3-8b", "--world", "8",
                          "--checkpoint-layers", "1000"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == (
        "python -m yashard.plan: error: --checkpoint-layers 1000: the model has 32 decoder layers; use a value "
        "between 0 and 32")


def test_gradient_accumulation_gives_fsdp2_its_gradient_shards_from_the_second_micro_batch(capsys):
    """FSDP2 holds no gradient shard before its first reduction of a step; with accumulation the
    later micro-batches start with all of them, ``4 N/W`` in fp32 (measured: docs/benchmarks.md,
    "With gradient accumulation"). The CLI's --grad-accum prints that peak, and N micro-batches of
    communication and compute."""
    from yashard.plan.__main__ import main
    from yashard.plan.activations import activations, shape_of
    from yashard.plan.peers import fsdp2_peak
    from yashard.plan.presets import preset_config

    shape = shape_of(preset_config("llama-3-8b"))
    acts = activations(shape, seq=4096, micro_batch=1, param_bytes=2, checkpoint_layers=32)
    one, later = (fsdp2_peak(shape, acts, world=8, param_bytes=2, accumulating=a) for a in (False, True))
    assert one.at == later.at == "loss backward"
    assert later.bytes - one.bytes == 4 * shape.total_numel // 8
    assert later.state == one.state  # (held between steps: the shards go with zero_grad)
    assert main(["--config", "llama-3-8b", "--world", "8", "--checkpoint-layers", "32", "--grad-accum", "4"]) == 0
    out = capsys.readouterr().out
    assert f"FSDP2                11.22    {later.bytes / 2**30:.2f}  loss backward" in out
    assert "4 micro-batches a step: FSDP2's peak is a later micro-batch's" in out
    assert "communication per rank and step, 4 micro-batches of 4096 tokens" in out
    with pytest.raises(SystemExit):
        main(["--config", "llama-3-8b", "--world", "8", "--grad-accum", "0"])
