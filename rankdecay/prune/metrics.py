"""State diagnostics: effective rank, rank utilisation and spectra of the recurrent states
(state-reduction paper Def. 2.2 / F.1, Figs. 2-4), and Head-in-Head's state-similarity entropy
(Table 6).

``state_diagnostics(model, ids)`` decodes ``ids`` [B, T] token by token with the cache and
reads every linear layer's state ``S_t`` [B, H, K, V] after each token:

- effective rank ``er(S) = ||S||_F^2 / ||S||_2^2``, rank utilisation ``u = er / min(K, V)``
  (``K`` is the model's key size; a pruned model's padding channels count as capacity it lacks);
- singular values of ``S_T`` (the last state), normalised by the largest;
- consecutive-state cosine similarity ``Sim(t) = <vec S_t, vec S_{t-1}> / (|S_t| |S_{t-1}|)``
  over all layers, its histogram on [-1, 1] (100 bins) and that histogram's Shannon entropy
  divided by log(100) (so in [0, 1]).
Positions before ``skip`` are left out of the averages (the paper skips the first 128 tokens).
"""
from __future__ import annotations

import math

import torch

from ..models.modeling import output_cache
from .core import linear_mixers


@torch.no_grad()
def state_diagnostics(model, ids: torch.Tensor, skip: int = 16, capacity_k: int | None = None) -> dict:
    mixers = linear_mixers(model)
    model.eval()
    B, T = ids.shape
    if T <= skip:
        raise ValueError(f"need more than skip = {skip} tokens, got {T}")
    erank = {i: [] for i in mixers}
    sims, prev = [], {}
    cache, last = None, {}
    for t in range(T):
        out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = output_cache(out)
        for i in mixers:
            S = cache.layers[i]["recurrent"].double()  # [B, H, K, V]
            flat = S.flatten(2)
            if i in prev:
                num = (flat * prev[i]).sum(-1)
                den = flat.norm(dim=-1) * prev[i].norm(dim=-1)
                ok = den > 0
                if t >= skip:
                    sims.append((num[ok] / den[ok]).cpu())
            prev[i] = flat
            if t >= skip:
                fro2 = (S ** 2).sum((-2, -1))
                top2 = torch.linalg.matrix_norm(S, ord=2) ** 2
                er = torch.where(top2 > 0, fro2 / top2.clamp_min(1e-300), torch.zeros_like(fro2))
                erank[i].append(er.cpu())
            last[i] = S
    res = {"layers": {}, "similarity": None}
    for i, m in mixers.items():
        util = torch.stack(erank[i]) / min(capacity_k or m.head_k_dim, m.head_v_dim)  # [steps, B, H]
        u = util.mean((0, 1))   # [H]
        e = torch.stack(erank[i]).mean((0, 1))
        sv = torch.linalg.svdvals(last[i]).mean(0)  # [H, min(K, V)]
        sv = sv / sv[:, :1].clamp_min(1e-300)
        res["layers"][i] = {"utilization": u, "effective_rank": e, "spectrum": sv,
                            "utilization_by_position": util.mean((1, 2))}
    if sims:
        s = torch.cat(sims).float()
        hist = torch.histc(s, bins=100, min=-1, max=1)
        p = hist / hist.sum()
        ent = float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(100))
        res["similarity"] = {"entropy": ent, "mean": float(s.mean()), "hist": hist}
    return res


def diagnostics_table(named: dict[str, dict]) -> str:
    """Markdown: per layer, mean rank utilisation and effective rank for each named model."""
    names = list(named)
    layers = sorted(next(iter(named.values()))["layers"])
    lines = ["| layer | " + " | ".join(f"{n} util. | {n} eff. rank" for n in names) + " |",
             "|---|" + "---:|---:|" * len(names)]
    for i in layers:
        cells = []
        for n in names:
            d = named[n]["layers"][i]
            cells += [f"{float(d['utilization'].mean()):.3f}", f"{float(d['effective_rank'].mean()):.2f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    ent = [f"{n}: {named[n]['similarity']['entropy']:.3f}" for n in names if named[n]["similarity"]]
    if ent:
        lines.append("\nstate-similarity entropy (normalised, Head-in-Head Table 6): " + ", ".join(ent))
    return "\n".join(lines)


def plot_diagnostics(named: dict[str, dict], path, layer: int | None = None, head: int = 0):
    """Two panels: the normalised singular values of one head's last state, and the mean rank
    utilisation by position, for each named model (paper Figs. 3-4)."""
    from .._plot import finish, pyplot

    plt = pyplot()
    if plt is None:
        return None
    first = next(iter(named.values()))
    layer = sorted(first["layers"])[0] if layer is None else layer
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for n, d in named.items():
        sv = d["layers"][layer]["spectrum"][head].cpu()
        a.semilogy(range(1, len(sv) + 1), sv.clamp_min(1e-12), label=n)
        pos = torch.stack([x["utilization_by_position"] for x in d["layers"].values()]).mean(0).cpu()
        b.plot(range(len(pos)), pos, label=n)
    a.set_title(f"singular values of S_T, layer {layer} head {head}")
    a.set_xlabel("index")
    a.set_ylabel("sigma_i / sigma_1")
    b.set_title("rank utilisation by position (mean over layers, heads)")
    b.set_xlabel("token (after the skipped prefix)")
    b.set_ylabel("u(S_t)")
    return finish(fig, [a, b], path)
