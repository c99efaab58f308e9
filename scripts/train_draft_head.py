"""Train an MTP draft head for the embedded SmolLM2 by self-distillation, then measure it.

    nice .venv/bin/python scripts/train_draft_head.py [--steps N] [--intermediate-size M] ...

1. Varied chat prompts (explanations, lists, stories, code, and edits of kvmesh source files)
   are split by subject into train and held-out sets; SmolLM2 answers each greedily.
2. Generation keeps, per position i, the target's final hidden state h_i and its argmax a_i
   (its next token). An MTP row at i takes (t_{i+1}, h_i) and learns
   a_{i+1}: cross-entropy at depth 1, and at depth 2 on (t_{i+2}, g_i) with its own g.
   Plain text (Python's standard library and package descriptions) adds prefill-only rows,
   which cost one target pass and no decoding.
3. Acceptance on held-out answers: at every answer position the head drafts k tokens chained
   exactly as at inference (kvmesh.engine.spec.mtp_eval), compared with the target's tokens.
The head is saved as safetensors in bfloat16 with its shape in the metadata
(kvmesh.engine.spec.mtp.load_mtp_head reads it back).
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.spec.mtp import MultiTokenPredictor, save_mtp_head
from kvmesh.engine.spec.mtp_eval import Sample, acceptance_per_position

SUBJECTS = (
    "photosynthesis",
    "the French revolution",
    "black holes",
    "sourdough bread",
    "volcanoes",
    "the immune system",
    "binary search",
    "hash tables",
    "the water cycle",
    "jazz music",
    "electric cars",
    "the Roman empire",
    "climate change",
    "machine learning",
    "chess openings",
    "coffee brewing",
    "the stock market",
    "honey bees",
    "solar panels",
    "the moon landing",
    "DNA replication",
    "recycling plastics",
    "the internet",
    "earthquakes",
    "vaccines",
    "gardening tomatoes",
    "the piano",
    "public transport",
    "rainforests",
    "linked lists",
    "sleep",
    "compilers",
    "the printing press",
    "whales",
    "renaissance painting",
    "tea",
    "marathon training",
    "quantum computers",
    "the Great Wall of China",
    "password security",
    "ocean tides",
    "the human heart",
    "video games",
    "bicycles",
    "cloud computing",
    "glaciers",
    "the Olympic games",
    "meditation",
    "sorting algorithms",
    "the periodic table",
)
TASKS = (
    "Explain {s} to a ten-year-old.",
    "Write a short paragraph about {s}.",
    "List five facts about {s}.",
    "What are the pros and cons of {s}?",
    "Write a haiku about {s}.",
    "Give me three questions a student might ask about {s}, with answers.",
    "Summarize the history of {s} in a few sentences.",
    "Write a Python function related to {s}, with a docstring.",
    "Write a short story that involves {s}.",
    "Describe {s} step by step.",
)
EDITS = (
    "Return this code unchanged except that every comment is removed.",
    "Return this code with the first function renamed to `run`.",
    "Add a one-line docstring to the first function and return the whole code.",
    "Return this code with all double quotes replaced by single quotes.",
)


def prompts(held_out: bool) -> list[str]:
    """Subjects with index % 5 == 4 and source files with index % 5 == 4 are held out."""
    out = [
        task.format(s=s)
        for i, s in enumerate(SUBJECTS)
        if (i % 5 == 4) == held_out
        for task in TASKS
    ]
    root = Path(__file__).resolve().parents[1] / "src" / "kvmesh"
    files = sorted(root.rglob("*.py"))
    for i, path in enumerate(files):
        if (i % 5 == 4) != held_out:
            continue
        lines = path.read_text().splitlines()
        start = random.Random(i).randrange(max(1, len(lines) - 30))
        code = "\n".join(lines[start : start + 30])
        out.append(f"{EDITS[i % len(EDITS)]}\n\n```python\n{code}\n```")
    return out


@torch.inference_mode()
def generate(loaded, texts: list[str], max_new: int, batch: int = 16) -> list[Sample]:
    """Greedy answers; every position's hidden state and argmax are kept as they are computed."""
    model, c = loaded.model, loaded.config
    eos = set(c.eos_token_ids)
    samples = []
    for lo in range(0, len(texts), batch):
        chats = [[{"role": "user", "content": t}] for t in texts[lo : lo + batch]]
        template = loaded.tokenizer.apply_chat_template
        seqs = [list(template(m, add_generation_prompt=True)["input_ids"]) for m in chats]
        plens = [len(s) for s in seqs]
        width = -(-(max(plens) + max_new) // 16)
        caches = allocate_kv_cache(c, width * len(seqs), 16, "cpu", torch.float32)
        tables = [list(range(j * width, (j + 1) * width)) for j in range(len(seqs))]
        hiddens: list[list[torch.Tensor]] = [[] for _ in seqs]
        argmaxes: list[list[torch.Tensor]] = [[] for _ in seqs]
        live, done = list(range(len(seqs))), [0] * len(seqs)  # done: tokens in the cache
        for _ in range(max_new):
            ids, pos, slots, qlens, ctxs = [], [], [], [], []
            for j in live:
                new = range(done[j], len(seqs[j]))
                ids += seqs[j][done[j] :]
                pos += new
                slots += [tables[j][p // 16] * 16 + p % 16 for p in new]
                qlens.append(len(new))
                ctxs.append(len(seqs[j]))
            meta = AttentionMetadata.build(slots, qlens, ctxs, [tables[j] for j in live])
            hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
            top = model.compute_logits(hidden).argmax(-1)
            for r, j in enumerate(live):
                a, b = meta.query_starts[r], meta.query_starts[r + 1]
                hiddens[j].append(hidden[a:b])
                argmaxes[j].append(top[a:b])
                done[j] = len(seqs[j])
                seqs[j].append(int(top[b - 1]))
            live = [j for j in live if seqs[j][-1] not in eos]
            if not live:
                break
        for j, s in enumerate(seqs):
            # the last sampled token was never fed back: keep rows for the tokens in the cache
            tokens = s[: done[j]]
            samples.append(Sample(tokens, torch.cat(hiddens[j]), torch.cat(argmaxes[j]), plens[j]))
        print(f"  generated {len(samples)}/{len(texts)}", flush=True)
    return samples


def corpus_windows(tokenizer, total: int, window: int, per_file: int = 4) -> list[list[int]]:
    """`total` tokens of plain text in `window`-token pieces, alternating Python's standard
    library (code and docstrings) with package descriptions (prose), at most `per_file` each."""
    paths = sysconfig.get_paths()
    code = sorted(Path(paths["stdlib"]).glob("*.py"))
    prose = sorted(Path(paths["purelib"]).glob("*.dist-info/METADATA"))
    order = [p for pair in zip(code, prose, strict=False) for p in pair]
    order += code[len(prose) :] + prose[len(code) :]
    windows: list[list[int]] = []
    for path in order if total > 0 else ():
        text = path.read_text(errors="ignore")[: per_file * window * 8]  # ~8 chars per token
        ids = tokenizer(text)["input_ids"]
        for lo in range(0, min(len(ids) - window + 1, per_file * window), window):
            windows.append(ids[lo : lo + window])
            if len(windows) * window >= total:
                return windows
    return windows


@torch.inference_mode()
def corpus_samples(loaded, windows: list[list[int]], batch: int = 8) -> list[Sample]:
    """Prefill-only samples: one target pass per `batch` windows (no answers to generate)."""
    model, c = loaded.model, loaded.config
    samples = []
    for lo in range(0, len(windows), batch):
        chunk = windows[lo : lo + batch]
        w, n = len(chunk[0]), len(chunk)
        caches = allocate_kv_cache(c, n, w, "cpu", torch.float32)  # one block per window
        meta = AttentionMetadata.build(
            list(range(n * w)), [w] * n, [w] * n, [[j] for j in range(n)]
        )
        ids = torch.tensor([t for win in chunk for t in win])
        hidden = model(ids, torch.arange(w).repeat(n), caches, meta)
        top = model.compute_logits(hidden).argmax(-1)
        for j, win in enumerate(chunk):
            rows = slice(j * w, (j + 1) * w)
            samples.append(Sample(win, hidden[rows].clone(), top[rows].clone(), w))
        if (lo // batch) % 10 == 0:
            print(f"  corpus {len(samples)}/{len(windows)} windows", flush=True)
    return samples


def batch_loss(mtp: MultiTokenPredictor, batch: list[Sample], depths: int) -> torch.Tensor:
    """Cross-entropy against the target's argmax at depths 1..depths, depth d weighted 1/d.

    Depth d's row i sits at position i + d - 1 and reads t_{i+d} with h_i (d = 1) or the g row
    i of depth d - 1; its label is a_{i+d}. Rows attend only within their own depth, a
    training-time stand-in for inference, where depth d > 1 attends to depth 1's history.
    """
    c = mtp.config
    loss = torch.zeros(())
    hidden = [s.hidden for s in batch]
    for depth in range(1, depths + 1):
        qlens = [len(s.tokens) - depth for s in batch]
        width = max(qlens)
        ids = torch.cat([torch.tensor(s.tokens[depth:]) for s in batch])
        labels = torch.cat([s.argmax[depth:] for s in batch])
        rows = torch.cat([h[:q] for h, q in zip(hidden, qlens, strict=True)])
        positions = torch.cat([torch.arange(depth - 1, depth - 1 + q) for q in qlens])
        slots = [j * width + p for j, q in enumerate(qlens) for p in range(q)]
        tables = [[j] for j in range(len(batch))]  # one block of `width` slots per sequence
        meta = AttentionMetadata.build(slots, qlens, qlens, tables)
        cache = torch.zeros(2, len(batch), width, c.num_key_value_heads, c.head_dim)
        g = mtp(ids, positions, rows, cache, meta, depth=depth)
        loss = loss + F.cross_entropy(mtp.compute_logits(g, depth), labels) / depth
        hidden = list(g.split(qlens))
    return loss


def train(mtp: MultiTokenPredictor, samples: list[Sample], args) -> None:
    params = list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps, pct_start=0.1)
    pick = random.Random(0)
    t0 = time.monotonic()
    for step in range(args.steps):
        batch = pick.sample(samples, min(args.batch, len(samples)))
        loss = batch_loss(mtp, batch, args.train_depth)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == args.steps - 1:
            rate = (step + 1) / (time.monotonic() - t0)
            print(f"  step {step} loss {loss.item():.3f} ({rate:.2f} steps/s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--batch", type=int, default=6, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-new", type=int, default=96, help="answer tokens per prompt")
    ap.add_argument("--intermediate-size", type=int, default=768, help="MTP block MLP width")
    ap.add_argument("--train-depth", type=int, default=2, help="chained depths trained")
    ap.add_argument("--num-speculative-tokens", type=int, default=3, help="k measured")
    ap.add_argument("--max-train-prompts", type=int, default=160, help="0: all")
    ap.add_argument("--max-test-prompts", type=int, default=48, help="0: all")
    ap.add_argument("--corpus-tokens", type=int, default=96_000, help="prefill-only text")
    ap.add_argument("--window", type=int, default=256, help="tokens per text window")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--data", default="", help="cache of generated samples (torch.save)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="src/kvmesh/engine/spec/heads/smollm2_mtp.safetensors")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(None)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    train_texts, test_texts = prompts(False), prompts(True)
    random.Random(0).shuffle(train_texts)
    random.Random(1).shuffle(test_texts)
    if args.max_train_prompts:
        train_texts = train_texts[: args.max_train_prompts]
    test_texts = test_texts[: args.max_test_prompts or None]
    t0 = time.monotonic()
    cached = torch.load(args.data, weights_only=False) if Path(args.data or "-").exists() else ()
    if cached:
        train_set, test_set = [Sample(*s) for s in cached[0]], [Sample(*s) for s in cached[1]]
    else:
        print(f"generating {len(train_texts)} train, {len(test_texts)} held-out", flush=True)
        train_set = generate(loaded, train_texts, args.max_new)
        test_set = generate(loaded, test_texts, args.max_new)
    if len(cached) > 2:
        corpus = [Sample(*s) for s in cached[2]]
    else:
        windows = corpus_windows(loaded.tokenizer, args.corpus_tokens, args.window)
        corpus = corpus_samples(loaded, windows) if windows else []
    if args.data and len(cached) < 3:
        torch.save(
            tuple([tuple(s) for s in part] for part in (train_set, test_set, corpus)), args.data
        )
    print(f"{len(train_set)} answers + {len(corpus)} text windows", flush=True)
    train_set = train_set + corpus
    print(f"data: {time.monotonic() - t0:.0f} s", flush=True)

    from dataclasses import replace

    mtp = MultiTokenPredictor(
        loaded.model, 1, replace(loaded.config, intermediate_size=args.intermediate_size)
    )
    mtp.init_from_target()
    before = acceptance_per_position(mtp, test_set, args.num_speculative_tokens)
    t1 = time.monotonic()
    train(mtp, train_set, args)
    print(f"train: {time.monotonic() - t1:.0f} s", flush=True)
    mtp.eval()
    after = acceptance_per_position(mtp, test_set, args.num_speculative_tokens)
    size = save_mtp_head(mtp, args.out, base_model=loaded.name)
    report = {
        "file": args.out,
        "bytes": size,
        "params": sum(p.numel() for p in mtp.parameters()),
        "held_out_prompts": len(test_set),
        "before_training": before._asdict(),
        "after_training": after._asdict(),
        "args": vars(args),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
