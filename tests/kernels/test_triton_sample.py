"""The one-pass sampling race (engine/sampling_race.py) against the engine's torch exponential race
(engine/sampler.py), in Triton's CPU interpreter: the same token for every row, seeded, greedy, at
strided and padded logits, in float32 and bf16; and the Sampler taking it only for batches it covers.
Skips where Triton is not installed (CI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (rows, vocab, padded width, block, slices, dtype)
CASES = [
    (5, 3000, 3000, 256, None, "float32"),
    (3, 777, 800, 128, 4, "bfloat16"),
    (1, 5000, 5000, 512, None, "float32"),
    (4, 1000, 1024, 256, 1, "float32"),
]
SCRIPT = """
import json, sys, torch
from tandem.engine.sampler import race_keys
from tandem.engine.sampling_race import race_sample
from tandem.engine.sampler import exponential_race

out = []
for rows, vocab, width, block, slices, dtype in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, width, generator=g) * 3).to(getattr(torch, dtype))
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[0] = 0.0  # a greedy row
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=g)
    steps = torch.randint(0, 5000, (rows,), generator=g)
    columns = race_keys(vocab, torch.device("cpu"))
    shape = {"vocab_size": vocab, "block": block, "slices": slices}
    got = race_sample(logits, temperature, seeds, steps, columns, **shape)
    raw = logits[:, :vocab].float()
    greedy = temperature < 1e-5
    scaled = raw / torch.where(greedy, 1.0, temperature)[:, None]
    want = torch.where(greedy, raw.argmax(-1), exponential_race(scaled, seeds, steps))
    # The noise on its own: at temperature -> infinity the race is argmax(-log E), so the kernel's
    # hash must match the reference's bit for bit for this to agree.
    flat = torch.zeros(rows, width).to(getattr(torch, dtype))
    big = torch.full((rows,), 1e30)
    noise_got = race_sample(flat, big, seeds, steps, columns, **shape)
    noise_want = exponential_race(torch.zeros(rows, vocab), seeds, steps)
    # Ties go to the lowest index, as torch.argmax's do, greedy: maxima one block apart (the same lane)
    # and in the last slice.
    tied = torch.zeros(rows, width).to(getattr(torch, dtype))
    tied[:, [3, 3 + block, vocab - 1]] = 5.0
    ties = race_sample(tied, torch.zeros(rows), seeds, steps, columns, **shape)
    # Nothing above -inf: index 0, torch.argmax's answer, never an index past the vocabulary.
    dead = torch.full((rows, width), float("-inf")).to(getattr(torch, dtype))
    dead_got = race_sample(dead, temperature, seeds, steps, columns, **shape)
    out.append({"got": got.tolist(), "want": want.tolist(), "noise_got": noise_got.tolist(),
                "noise_want": noise_want.tolist(), "dtype": str(got.dtype), "ties": ties.tolist(),
                "tie_want": [3] * rows, "dead": dead_got.tolist()})
print(json.dumps(out))
"""


def test_picks_the_torch_race_token_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    results = triton_interpreter(SCRIPT, CASES)
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results, strict=True):
        assert result["dtype"] == "torch.int64"
        assert result["got"] == result["want"], (case, result)
        assert result["noise_got"] == result["noise_want"], (case, result)
        assert result["ties"] == result["tie_want"], (case, result)
        assert result["dead"] == [0] * case[0], (case, result)


SAMPLER_SCRIPT = """
import json, sys, torch
from tandem.engine.batch import SamplingBatch
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_race import race_sample

rows, vocab = 6, 700
g = torch.Generator().manual_seed(5)
logits = (torch.randn(rows, 768, generator=g) * 3).to(torch.bfloat16)  # a padded LM head
temps = torch.rand(rows, generator=g) + 0.3
temps[1] = 0.0
seeds = torch.randint(0, 2**40, (rows,), generator=g)

def batch(**flags):
    base = dict(
        temperature=temps, top_p=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64),
        min_p=torch.zeros(rows), seeds=seeds,
        steps=torch.arange(rows) * 3, presence_penalty=torch.zeros(rows), frequency_penalty=torch.zeros(rows),
        repetition_penalty=torch.ones(rows), any_top_k_top_p=False, any_min_p=False, any_explicit_seed=True,
        any_greedy=True,
    )
    return SamplingBatch(**{**base, **flags})

calls = []
def counted(*args, **kwargs):
    calls.append(1)
    return race_sample(*args, **kwargs)

torch_path, one_pass = Sampler(vocab), Sampler(vocab, race=counted)
out = {}
for name, flags in {"plain": {}, "top_k": {"any_top_k_top_p": True}, "logprobs": {"num_logprobs": 0}}.items():
    before = len(calls)
    want, got = torch_path(logits, batch(**flags)), one_pass(logits, batch(**flags))
    out[name] = {"same": want.next_tokens.tolist() == got.next_tokens.tolist(), "race": len(calls) > before,
                 "logprobs": got.logprobs is not None}
out["warm_up"] = one_pass.warm_up(torch.float32)
# A race that answers wrongly is switched off at warm-up, and the sampler keeps to the torch path.
wrong = Sampler(vocab, race=lambda *args, **kwargs: torch.zeros(args[0].shape[0], dtype=torch.int64))
out["wrong_warm_up"] = wrong.warm_up(torch.float32)
after = wrong(logits, batch()).next_tokens
out["wrong_after"] = after.tolist() == torch_path(logits, batch()).next_tokens.tolist()
print(json.dumps(out))
"""


def test_the_sampler_takes_the_race_only_where_it_covers_the_batch(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    out = triton_interpreter(SAMPLER_SCRIPT, None)
    # Temperatures and seeds only: the one pass, with the torch race's tokens.
    assert out["plain"] == {"same": True, "race": True, "logprobs": False}
    # A filter on or logprobs asked: the torch path, its tokens and its logprobs.
    assert out["top_k"] == {"same": True, "race": False, "logprobs": False}
    assert out["logprobs"] == {"same": True, "race": False, "logprobs": True}
    # Warm-up builds every slice count and agrees; a wrong race is caught there and not used after.
    assert out["warm_up"] is None
    assert "one-pass sampling race off" in out["wrong_warm_up"] and out["wrong_after"]


MASKED_SCRIPT = """
import json, sys, torch
from dataclasses import replace
from tandem.engine.batch import SamplingBatch
from tandem.engine.sampler import Sampler, _pack_bits, race_keys
from tandem.engine.sampling_race import race_sample

rows, vocab, width, tokenizer = 6, 700, 768, 650  # a head padded past the model's vocab and the tokenizer
g = torch.Generator().manual_seed(11)
logits = (torch.randn(rows, width, generator=g) * 3).to(torch.bfloat16)
temps = torch.rand(rows, generator=g) + 0.3
temps[4] = 0.0  # a greedy constrained row
seeds = torch.randint(0, 2**40, (rows,), generator=g)
steps = torch.arange(rows) * 5
constrained = [4, 1, 5]  # not in batch order
allowed = torch.rand(3, tokenizer, generator=g) < 0.05
allowed[0, :] = False
allowed[0, [7, 300, 649]] = True  # the greedy row: three tokens, the last id the tokenizer has
allowed[2, :] = False  # nothing allowed: the row gets 0, as for all -inf logits
bitmask = _pack_bits(allowed)
batch = SamplingBatch.greedy(rows)
batch = replace(batch, temperature=temps, seeds=seeds, steps=steps, all_greedy=False, any_greedy=True,
                any_explicit_seed=True, bitmask=bitmask, bitmask_rows=torch.tensor(constrained),
                bitmask_vocab=tokenizer)
want = Sampler(vocab)(logits, batch).next_tokens  # the torch path: xgrammar's mask on a float32 copy
columns = race_keys(vocab, torch.device("cpu"))
out = {"want": want.tolist(), "got": {}}
for slices in (1, 4, None):
    got = race_sample(logits, temps, seeds, steps, columns, vocab_size=vocab, block=128, slices=slices,
                      bitmask=bitmask, bitmask_rows=batch.bitmask_rows, bitmask_vocab=tokenizer)
    out["got"][str(slices)] = got.tolist()
plain = race_sample(logits, temps, seeds, steps, columns, vocab_size=vocab, block=128)
out["plain"] = plain.tolist()
out["allowed"] = {str(r): allowed[i].nonzero().flatten().tolist() for i, r in enumerate(constrained)}
out["argmax_allowed_4"] = int(torch.where(allowed[0], logits[4, :tokenizer].float(), -torch.inf).argmax())
print(json.dumps(out))
"""


def test_masks_structured_rows_inside_the_race_in_the_interpreter(
    triton_interpreter: Callable[[str, object], Any],
) -> None:
    out = triton_interpreter(MASKED_SCRIPT, None)
    want = out["want"]
    for slices, got in out["got"].items():
        # Every row as the torch path draws it after xgrammar's mask, whatever the slicing.
        assert got == want, slices
    for row, allowed in out["allowed"].items():
        if allowed:
            assert want[int(row)] in allowed, row  # a constrained row draws only what its grammar allows
        else:
            assert want[int(row)] == 0, row
    assert want[4] == out["argmax_allowed_4"]  # greedy and constrained: the best allowed token
    # Unconstrained rows are drawn as with no mask at all; the constrained ones were moved by it.
    assert [want[r] for r in (0, 2, 3)] == [out["plain"][r] for r in (0, 2, 3)]
    assert any(want[r] != out["plain"][r] for r in (1, 4, 5))
