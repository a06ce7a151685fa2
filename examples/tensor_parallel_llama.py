"""Train a small patched Llama with tensor + sequence parallelism (and FSDP2 on a 2-D mesh) under torchrun.

    torchrun --nproc_per_node=2 examples/tensor_parallel_llama.py                # TP over 2 ranks (gloo on CPU)
    torchrun --nproc_per_node=4 examples/tensor_parallel_llama.py --dp 2         # FSDP2 x TP on a 2 x 2 mesh
    torchrun --nproc_per_node=2 examples/tensor_parallel_llama.py --device cuda  # nccl on 2 GPUs

Each rank builds the same model (seed 0), `opforge.patch.apply` patches it and `opforge.parallel.parallelize` shards
it over the "tp" dimension of the mesh; the loss is vocabulary-parallel. Rank 0 prints the loss of every step and,
with --check, the single-process losses of the same batches and the largest relative difference (exit status 1 above
--rtol).
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import opforge
from opforge.parallel import parallelize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) size; tp = ranks / dp")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--check", action="store_true", help="compare with the single-process run")
    ap.add_argument("--rtol", type=float, default=1e-4)
    a = ap.parse_args()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(a.device, (a.dp, world // a.dp), mesh_dim_names=("dp", "tp"))

    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(a.device)
    opforge.patch.apply(model)
    single = copy.deepcopy(model) if a.check else None
    parallelize(model, mesh["tp"])
    if a.dp > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(a.device) for _ in range(a.steps)]
    dp_rank = mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, ids in enumerate(batches):
        ids = ids.chunk(a.dp, 0)[dp_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.full_tensor().detach().reshape(1)
        dist.all_reduce(value, group=mesh["dp"].get_group())
        losses.append(float(value) / a.dp)
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    status = 0
    if a.check:
        opt1 = torch.optim.AdamW(single.parameters(), lr=1e-3)
        ref = []
        for ids in batches:
            loss = single(input_ids=ids, labels=ids).loss
            loss.backward()
            opt1.step()
            opt1.zero_grad(set_to_none=True)
            ref.append(float(loss.detach()))
        rel = max(abs(x - y) / abs(y) for x, y in zip(losses, ref))
        if rank == 0:
            print(f"single process: {[round(x, 6) for x in ref]}\nlargest relative difference {rel:.2e}", flush=True)
        status = int(rel > a.rtol)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
