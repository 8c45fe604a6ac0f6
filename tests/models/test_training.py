"""Every mixer learns a toy copy task in a few hundred CPU steps."""
import math

import pytest
import torch

from rankdecay.models import MIXERS, RankDecayConfig, RankDecayForCausalLM

SYMBOLS, LENGTH, SEP = 8, 4, 256


def copy_batch(gen: torch.Generator, batch: int = 32):
    """``x SEP x`` for random x of LENGTH symbols; only the copy is scored."""
    x = torch.randint(0, SYMBOLS, (batch, LENGTH), generator=gen)
    ids = torch.cat([x, torch.full((batch, 1), SEP), x], 1)
    labels = ids.clone()
    labels[:, :LENGTH + 1] = -100
    return ids, labels


@pytest.mark.slow
@pytest.mark.parametrize("mixer", MIXERS)
def test_tiny_model_learns_to_copy(mixer):
    torch.manual_seed(0)
    model = RankDecayForCausalLM(RankDecayConfig.from_preset("tiny", mixer=mixer, hh_rank=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    # plain linear attention (no decay, no delta rule) learns the copy more slowly: over seeds 0-7 it was below the
    # bar at step 200 for 6 of 8 (seed 0: 1.37 averaged, seed 6: about 2.08) and at step 400 for all 8 (largest
    # 0.72, seed 0); CI's seed 0 passed at 200 until session 39, on another CPU
    steps = 400 if mixer == "linear_attn" else 200
    for _ in range(steps):
        ids, labels = copy_batch(gen)
        loss = model(ids, labels=labels, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.8 * math.log(model.config.vocab_size), "a fresh model should be near uniform"
    final = sum(losses[-10:]) / 10
    # ln 8 = 2.08 is the loss of knowing the alphabet but not the sequence; below half of
    # that the model must be reading the copied symbols from its state.
    assert final < 0.5 * math.log(SYMBOLS), (
        f"{mixer}: copy loss {final:.3f} after {steps} steps (start {losses[0]:.3f})")
