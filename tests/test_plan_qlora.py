"""``python -m yashard.plan --qlora`` (issue 43): a QLoRA run planned on the meta device, with the
plan of a real 4-bit PEFT model row for row, and its flags' usage errors. One process, CPU
(bitsandbytes 0.50 quantises NF4 on CPU)."""

import pytest
import torch

import yashard
from yashard.plan.qlora import dequantized_bytes, qlora_model, quant_parts

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

# (double quantisation, quant storage)
VARIANTS = [(True, torch.uint8), (False, torch.uint8), (True, torch.bfloat16), (False, torch.bfloat16)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from qlora_workers import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("tiny")))


def _real(folder, double_quant, storage, rank, targets):
    """A real tiny 4-bit PEFT model, as tests/qlora_workers.py builds one (weights bf16)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                             bnb_4bit_quant_storage=storage, bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, dtype=torch.bfloat16)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))


@pytest.mark.parametrize("double_quant, storage", VARIANTS)
def test_the_meta_plan_equals_a_real_4bit_peft_models_row_for_row(folder, double_quant, storage):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    for rank, targets in ((4, "all-linear"), (8, ["q_proj", "v_proj"])):
        real = _real(folder, double_quant, storage, rank, targets)
        meta = qlora_model(cfg, rank=rank, targets=targets, double_quant=double_quant, quant_storage=storage)
        assert all(p.device.type == "meta" for p in meta.parameters())
        assert dequantized_bytes(meta, 2) == dequantized_bytes(real, 2) == 128 * 64 * 2
        for world in (2, 3):
            config = yashard.ShardConfig(param_dtype=torch.bfloat16, checkpoint_layers=2)
            want = yashard.plan(real, world_size=world, config=config, backend="gloo")
            got = yashard.plan(meta, world_size=world, config=config, backend="gloo")
            assert any(r.name == "4-bit shards" and r.bytes > 0 for r in got.rows)
            assert got.rows == want.rows and got.adamw_bytes == want.adamw_bytes, (got, want)


@pytest.mark.parametrize("shape", [(64, 64), (96, 200), (3, 7), (300, 257), (1024, 1088)])
def test_the_parts_are_what_quantize_4bit_makes(shape):
    import bitsandbytes.functional as F

    w = torch.randn(shape, dtype=torch.bfloat16)
    for double_quant, storage in VARIANTS:
        try:
            data, state = F.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4",
                                          quant_storage=storage)
        except RuntimeError:  # (bitsandbytes cannot view an odd number of packed bytes as bf16)
            with pytest.raises(ValueError, match="bitsandbytes cannot quantise it with that quant_storage; use uint8"):
                quant_parts(w.numel(), double_quant=double_quant, quant_storage=storage)
            continue
        real = {"data": data, **{f"qs.{k}": v for k, v in vars(state).items() if torch.is_tensor(v)}}
        if state.state2 is not None:
            real.update({f"qs.state2.{k}": v for k, v in vars(state.state2).items() if torch.is_tensor(v)})
        got = quant_parts(w.numel(), double_quant=double_quant, quant_storage=storage)
        assert got == {k: (v.dtype, tuple(v.shape)) for k, v in real.items()}, (shape, double_quant, storage)


def test_a_frozen_lm_head_has_no_weight_gradient_moment():
    from yashard.plan.activations import activations, shape_of, yashard_peak
    from yashard.plan.presets import preset_config

    shape = shape_of(preset_config("llama-3-8b"))
    acts = activations(shape, seq=1024, micro_batch=1, param_bytes=2, checkpoint_layers=32)
    trains, frozen = (dict((m.name, m.bytes) for m in yashard_peak(0, shape, acts, head_trains=t).moments)
                      for t in (True, False))
    assert trains["lm_head backward"] - frozen["lm_head backward"] == shape.vocab * shape.hidden * 2


def test_the_cli_prints_the_real_models_plan_and_yashards_peak_alone(folder, capsys):
    from yashard.plan.__main__ import main, report

    assert main(["--config", folder, "--world", "2", "--qlora", "--lora-rank", "4", "--no-double-quant",
                 "--quant-storage", "bf16", "--seq-len", "16", "--checkpoint-layers", "2", "--gpu-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    real = yashard.plan(_real(folder, False, torch.bfloat16, 4, "all-linear"), world_size=2,
                        config=yashard.ShardConfig(param_dtype=torch.bfloat16, checkpoint_layers=2))
    assert report(real, 2**30) in out
    assert "QLoRA: NF4, bf16 storage, LoRA r=4 on all-linear" in out
    assert "FSDP2 and DeepSpeed ZeRO-3: not modelled for QLoRA (--qlora)" in out
    assert "\n  FSDP2    " not in out and "\n  DeepSpeed ZeRO-3 " not in out and "FSDP2: wrapped" not in out
    assert "communication: not modelled for --qlora" in out
    peaks = [line for line in out.splitlines() if line.startswith("  yashard  ")]
    assert len(peaks) == 1 and " yes " in peaks[0]


def test_llama_3_70b_qlora_fits_24gib_at_w4(capsys):
    """The issue's acceptance command: NF4 with double quantisation, r=16 on all linear layers."""
    from yashard.plan.__main__ import main

    assert main(["--config", "llama-3-70b", "--world", "4", "--qlora", "--lora-rank", "16", "--lora-targets",
                 "all-linear", "--seq-len", "2048", "--checkpoint-layers", "80", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "NF4 with double quantisation, uint8 storage, LoRA r=16 on all-linear" in out
    assert "model state leaves" in out
    peak = next(line for line in out.splitlines() if line.startswith("  yashard  "))
    assert " yes " in peak, peak


@pytest.mark.parametrize("args, message", [
    (["--lora-rank", "4"], "--lora-rank plans a QLoRA run: add --qlora, or drop --lora-rank"),
    (["--quant-storage", "bf16"], "--quant-storage plans a QLoRA run: add --qlora"),
    (["--no-double-quant"], "--double-quant plans a QLoRA run: add --qlora"),
    (["--lora-targets", "q_proj"], "--lora-targets plans a QLoRA run: add --qlora"),
    (["--qlora", "--lora-rank", "0"], "--lora-rank 0: LoRA's rank, use 1 or more"),
    (["--qlora", "--quantized-weights", "8"], "--quantized-weights 8 with --qlora: the 4-bit layers already gather "
                                              "packed bytes; drop --quantized-weights"),
    (["--qlora", "--lora-targets", "no_such_proj"], "--lora-targets no_such_proj: Target modules {'no_such_proj'} "
                                                    "not found"),
    (["--qlora", "--quant-storage", "int4"], "--quant-storage: invalid choice: 'int4'"),
    (["--qlora", "--share-outer-slot"], "--share-outer-slot does not work with a 4-bit base"),
    (["--qlora", "--secondary-group-size", "1"], "--secondary-group-size (hpZ) does not work with a 4-bit base"),
])
def test_a_bad_qlora_flag_is_a_usage_error(folder, args, message, capsys):
    from yashard.plan.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--config", folder, "--world", "2", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert "Traceback" not in err
