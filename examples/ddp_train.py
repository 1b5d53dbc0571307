"""Train a small embedding model with fused_triplet's loss under DistributedDataParallel.

    torchrun --nproc_per_node 2 examples/ddp_train.py   # NCCL, a GPU per rank; gloo on CPU without

Every rank draws the same global batch of triplets and trains on its slice; DDP averages the
gradients. With --check-grads, rank 0 also runs one single-process step of torch's own
TripletMarginLoss on the whole global batch from the same initial weights and checks that
the DDP gradients equal it (the test suite runs this).

--mined: a labelled global batch instead, each rank embedding its slice; gather_across_ranks
joins the embeddings (the gradient flows back to each rank's rows) and every rank computes the
batch-hard loss of the global batch, times the world size (DDP averages the ranks' gradients).
--check-grads then compares with the single-process mined loss of the global batch.
"""

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared machines)

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_triplet  # noqa: E402


def make_model(in_dim: int, emb_dim: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(in_dim, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, emb_dim))


def global_batch(step: int, size: int, in_dim: int):
    """The same (anchor, positive, negative) inputs on every rank for a given step."""
    g = torch.Generator().manual_seed(1000 + step)
    anchor = torch.randn(size, in_dim, generator=g)
    positive = anchor + 0.1 * torch.randn(size, in_dim, generator=g)
    negative = anchor + 0.3 * torch.randn(size, in_dim, generator=g)  # hard negatives
    return anchor, positive, negative


def labelled_global_batch(step: int, size: int, in_dim: int):
    """The same (inputs, labels) on every rank for a given step: 8 inputs per label."""
    g = torch.Generator().manual_seed(2000 + step)
    labels = torch.arange(size) // 8
    return torch.randn(labels.max().item() + 1, in_dim, generator=g)[labels] + \
        0.5 * torch.randn(size, in_dim, generator=g), labels


def mined_loss(embeddings, labels):
    return fused_triplet.mined_triplet_margin_loss(embeddings, labels, "batch_hard", margin=0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    has_gpu = torch.cuda.is_available()
    parser.add_argument("--backend", default="nccl" if has_gpu else "gloo")
    parser.add_argument("--device", default="cuda" if has_gpu else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--in-dim", type=int, default=128)
    parser.add_argument("--emb-dim", type=int, default=64)
    parser.add_argument("--check-grads", action="store_true")
    parser.add_argument("--mined", action="store_true",
                        help="the batch-hard loss of a labelled global batch (gather_across_ranks)")
    args = parser.parse_args()
    if args.device == "cuda" and not has_gpu:
        parser.error("--device cuda: no CUDA GPU is visible (leave --device and --backend out to "
                     "train on the CPU with gloo)")

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    assert args.global_batch % world == 0
    local = args.global_batch // world

    model = make_model(args.in_dim, args.emb_dim, seed=0).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = fused_triplet.TripletMarginLoss(margin=1.0)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)

    status = 0
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        if args.mined:
            inputs, labels = (x[rank * local:(rank + 1) * local].to(device)
                              for x in labelled_global_batch(step, args.global_batch, args.in_dim))
            embeddings, every_label = fused_triplet.gather_across_ranks(ddp(inputs), labels)
            loss = mined_loss(embeddings, every_label)
            (loss * world).backward()  # each rank's rows' share; DDP's average divides by world
        else:
            batch = [x[rank * local:(rank + 1) * local].to(device)
                     for x in global_batch(step, args.global_batch, args.in_dim)]
            loss = criterion(*ddp(torch.cat(batch)).split(local))  # one DDP forward per backward
            loss.backward()
        if step == 0 and args.check_grads and rank == 0:
            status = check_against_single_process(model, args, device)
        optimizer.step()
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum)  # the mined loss is the global batch's on every rank already
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss_sum.item() / world:.4f}", flush=True)
    dist.destroy_process_group()
    return status


def check_against_single_process(model, args, device) -> int:
    """DDP's averaged gradients vs one process, torch's loss (or the mined one), the whole
    global batch."""
    reference = make_model(args.in_dim, args.emb_dim, seed=0).to(device)
    if args.mined:
        inputs, labels = (x.to(device) for x in labelled_global_batch(0, args.global_batch,
                                                                       args.in_dim))
        mined_loss(reference(inputs), labels).backward()
    else:
        batch = [x.to(device) for x in global_batch(0, args.global_batch, args.in_dim)]
        torch.nn.TripletMarginLoss(margin=1.0)(*(reference(x) for x in batch)).backward()
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters()))
    scale = max(q.grad.abs().max().item() for q in reference.parameters())
    ok = scale > 0 and worst <= 1e-5 * scale
    print(f"DDP gradients vs single process: max difference {worst:.2e}, largest gradient "
          f"{scale:.2e} ({'ok' if ok else 'MISMATCH'})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
