"""The default model (SmolLM2-135M-Instruct GGUF) end to end, vs transformers on the same file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import greedy_generate, make_runner
from radixserve.model.source import default_model_path

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a short poem about the moon.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def hf_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    kwargs = {"gguf_file": path.name}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    return tokenizer, model.eval()


def test_greedy_matches_transformers_on_the_same_gguf(hf_gguf):
    tokenizer, reference = hf_gguf
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    # fp32 against transformers' fp32: the file's weights dequantized (the default, auto,
    # runs the Q4_1 blocks as they are with bf16 matmul inputs; see the test below)
    runner = make_runner(None, max_total_tokens=2048, quantization="none")
    ours = greedy_generate(runner, ids, 32, [tokenizer.eos_token_id])  # one batch of four
    for prompt_ids, tokens in zip(ids, ours):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False
            )  # stops after the EOS token, as ours does
        assert tokens == out[0, len(prompt_ids) :].tolist()
    assert "Paris" in tokenizer.decode(ours[0])


def test_cli_generate_runs_the_default_model():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "generate",
            "--chat",
            "--max-new-tokens",
            "12",
            "What is the capital of France?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr
