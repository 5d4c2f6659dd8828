"""The nanoGPT-style loop hpc_train's trainer is measured against: the same GPT, batch and precision, with plain
PyTorch (AdamW, SDPA attention inside the model, bf16 autocast on a GPU) and nothing else: no DeepSpeed, no
checkpoints, no monitoring.

    python benchmarks/gpu_baseline.py --model 125M --seq-len 1024 --micro-batch 8 --steps 20 [--compile]

Prints one JSON line: tokens/s over the timed steps, the model's parameters and FLOPs per token, and MFU against
the device's dense peak (:func:`hpc_train.rank.runtime.flops.peak_flops`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hpc_train.rank.runtime.flops import flops_per_token, mfu, peak_flops
from hpc_train.rank.train.model import GPT, GPTConfig, count_parameters

VOCAB = 50304  # GPT-2's vocabulary rounded up to a multiple of 64, as nanoGPT does


def run(model_name: str, seq_len: int, micro_batch: int, steps: int, warmup: int, compile_model: bool,
        vocab: int = VOCAB) -> dict[str, object]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    config = GPTConfig.from_preset(model_name, vocab, seq_len)
    model = GPT(config, None, seed=1234).to(device)  # no tensor-parallel group: one process
    parameters = sum(p.numel() for p in model.parameters())
    # FLOPs as hpc_train's GPT spec counts them: the matmul weights, neither the position nor the input embedding.
    matmul_parameters = count_parameters(config) - (config.vocab_size + config.seq_len) * config.hidden
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    step_fn = torch.compile(model) if compile_model else model
    generator = torch.Generator(device="cpu").manual_seed(0)
    data = torch.randint(0, vocab, (warmup + steps, micro_batch, seq_len + 1), generator=generator)
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    start = 0.0
    for index in range(warmup + steps):
        if index == warmup:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        batch = data[index].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = steps * micro_batch * seq_len / seconds
    per_token = flops_per_token(matmul_parameters, config.layers, config.hidden, seq_len)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {"model": model_name, "parameters": parameters, "compile": compile_model, "dtype": str(dtype),
            "tokens_per_s": tokens_per_s, "flops_per_token": per_token, "device": name,
            "mfu": mfu(tokens_per_s, per_token, peak_flops(name, "bf16" if dtype == torch.bfloat16 else "fp32")),
            "final_loss": float(loss.item())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="125M")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run(args.model, args.seq_len, args.micro_batch, args.steps, args.warmup, args.compile,
                         args.vocab)))


if __name__ == "__main__":
    main()
