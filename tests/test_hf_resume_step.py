"""A Trainer checkpoint whose sharded state (``checkpoint-N/yashard/``) is from another step than its
``trainer_state.json`` is refused at resume, naming both steps; one written by the trainer resumes.

Two gloo ranks on CPU, a tiny Qwen2, gradient accumulation 2; workers in tests/hf_init_workers.py."""

from __future__ import annotations

import pytest

import hf_init_workers
from harness import run_distributed

pytestmark = pytest.mark.slow


def test_a_checkpoint_mixing_two_steps_is_refused_naming_both(tmp_path):
    got = run_distributed(hf_init_workers.resume_mixed, 2, str(tmp_path))[0]
    assert [s["step"] for s in got["resumed"]] == [1, 2, 3]  # (checkpoint-2 as written resumes)
    message = got["message"]
    assert "its sharded state (yashard/) was saved at step 2, its trainer_state.json at step 4" in message, message
    assert "Resume from a checkpoint-N folder as the trainer wrote it" in message
    assert "copy the yashard/ folder of checkpoint-4 into it" in message
