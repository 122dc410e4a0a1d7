"""Train the demo model that `tandem serve` serves with no arguments, and write it to engine/tiny/demo/.

The demo is a two-layer Llama trained on the bundled corpus (engine/tiny/corpus.txt) and on short chats
(scripts/demo_chats.txt), so that its answers are readable words: it mostly recites and recombines the
corpus. Its tokenizer is a BPE over the corpus's characters (no byte-level alphabet), so no token renders
as a control character; characters outside the corpus encode as `<unk>`. The random-weight test models of
`make_tiny_model` are not affected.

    python scripts/train_demo_model.py            # 4-7 minutes on one CPU core

Training is seeded, but float summation order differs across torch builds and CPUs, so a re-run gives a
similar model, not the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tandem.engine.tiny.tokenizer import (
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    MODEL_MAX_LENGTH,
    corpus_text,
    wrap_backend,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "engine" / "tiny" / "demo"
CHATS = Path(__file__).resolve().parent / "demo_chats.txt"

UNK_TOKEN = "<unk>"
VOCAB_SIZE = 1024
SEQ_LEN = 128

# Two layers at width 128 keep the float32 weights under 2 MB (about 0.43 M parameters).
MODEL: dict[str, int | float | bool] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def read_chats() -> list[tuple[str, str]]:
    """(user, assistant) pairs: blocks of two lines separated by blank lines."""
    pairs = []
    for block in CHATS.read_text(encoding="utf-8").strip().split("\n\n"):
        user, assistant = block.strip().split("\n")
        pairs.append((user, assistant))
    return pairs


def corpus_paragraphs() -> list[str]:
    """The corpus's prose paragraphs (several sentences, no code), used as assistant answers."""
    paragraphs = [p.strip() for p in corpus_text().split("\n\n")]
    return [p for p in paragraphs if p.count(". ") >= 1 and "\n" not in p and p[0].isalpha() and p.isascii()]


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A character BPE with SentencePiece-style spaces; the alphabet is exactly the training text's."""
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    specials = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(specials),
        min_frequency=2,
        special_tokens=[UNK_TOKEN],
        initial_alphabet=sorted(set("".join(texts))),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return wrap_backend(tok, unk_token=UNK_TOKEN)


def portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class and its extra specials the way transformers 4.x reads them too (5.x still
    does): the shipped files outlive the transformers version that wrote them."""
    config = json.loads(path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [IM_START_TOKEN, IM_END_TOKEN])
    path.write_text(json.dumps(config, indent=2) + "\n")


def chat_text(tokenizer: PreTrainedTokenizerFast, user: str, assistant: str) -> str:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False))


def token_stream(tokenizer: PreTrainedTokenizerFast, rng: random.Random, rounds: int) -> list[int]:
    """The corpus once per round plus chats: the written pairs, and random prompts answered with corpus
    paragraphs, so the model learns both to answer after `assistant` and to stop with `<|im_end|>`."""
    chats, paragraphs = read_chats(), corpus_paragraphs()
    prompts = [user for user, _ in chats]
    docs: list[str] = []
    for _ in range(rounds):
        docs.append(corpus_text() + EOS_TOKEN)
        docs += [chat_text(tokenizer, user, answer) for user, answer in chats]
        docs += [chat_text(tokenizer, rng.choice(prompts), rng.choice(paragraphs)) for _ in range(len(chats))]
    rng.shuffle(docs)
    return [int(i) for i in tokenizer("".join(docs))["input_ids"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)

    pairs = read_chats()
    tokenizer = train_tokenizer([corpus_text(), *(f"{u}\n{a}" for u, a in pairs)])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, IM_END_TOKEN)}
    stream = torch.tensor(token_stream(tokenizer, rng, rounds=4))
    print(f"vocab {len(tokenizer)}, training stream {len(stream)} tokens")

    config = LlamaConfig(
        **MODEL,
        vocab_size=len(tokenizer),
        max_position_embeddings=MODEL_MAX_LENGTH,
        bos_token_id=ids[EOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        pad_token_id=ids[EOS_TOKEN],
    )
    model = LlamaForCausalLM(config).to(torch.float32).train()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = 50
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))),
    )
    gen = torch.Generator().manual_seed(0)
    start = time.monotonic()
    for step in range(args.steps):
        offsets = torch.randint(0, len(stream) - SEQ_LEN - 1, (args.batch,), generator=gen)
        batch = torch.stack([stream[o : o + SEQ_LEN + 1] for o in offsets.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.monotonic() - start:.0f}s", flush=True)

    model.eval()
    eos = [ids[EOS_TOKEN], ids[IM_END_TOKEN]]
    model.generation_config = GenerationConfig(bos_token_id=eos[0], eos_token_id=eos, pad_token_id=eos[0])
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    portable_tokenizer_config(args.out / "tokenizer_config.json")
    for file in args.out.iterdir():
        file.chmod(0o644)  # transformers writes the weights 0600; the package's files are world-readable
    messages = [{"role": "user", "content": "Hello!"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"Hello! -> {answer!r}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
