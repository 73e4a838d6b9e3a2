"""Grounded draft heads (Hydra, section 3.2): K small MLPs over the target's final hidden state
that predict the tokens after the target's own next token, each conditioned on the tokens
before it; trained by train.py, drafting in the verifier through draft.py.

Head k (k = 1..K) predicts x_{t+1+k} from f_t (+) E(x_{t+1}) (+) ... (+) E(x_{t+k}) (f_t the
target's final hidden state at x_t, E its input embeddings, (+) concatenation) as
`h = f_t + W2 silu(W1 input)`, W2 zero at start (Medusa's residual head, which Hydra keeps),
read out by the target's frozen LM head (docs/heads.md, The heads). Deviation from Hydra: the
LM head may keep only a draft vocabulary's rows (`vocab`, as FR-Spec; logits over its columns,
`columns` maps token ids to them; docs/decisions/heads-training.md).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class GroundedHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, embed: torch.Tensor,
                 lm_head: torch.Tensor, grounded: bool = True,
                 vocab: torch.Tensor | None = None) -> None:
        """`embed` [V, H] and `lm_head` [V, H]: the target's (kept frozen, not trained).
        `grounded=False`: Medusa's heads, on f_t alone (the paper's baseline). `vocab`: sorted
        token ids the LM head keeps (None: all V)."""
        super().__init__()
        if num_heads < 1:
            raise ValueError("need at least one head")
        self.hidden_size, self.num_heads, self.grounded = hidden_size, num_heads, grounded
        size = lm_head.shape[0]
        if vocab is None:
            vocab = torch.arange(size)
        vocab = vocab.long()
        if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {size})")
        self.register_buffer("vocab", vocab.clone())  # saved with the weights
        columns = torch.full((size,), -1, dtype=torch.long)
        columns[vocab] = torch.arange(vocab.numel())
        self.register_buffer("columns", columns, persistent=False)  # token id -> column (-1)
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach()[vocab] if vocab.numel() < size
                             else lm_head.detach(), persistent=False)
        self.up = nn.ModuleList(nn.Linear(hidden_size * (k + 1 if grounded else 1), hidden_size)
                                for k in range(1, num_heads + 1))
        self.down = nn.ModuleList(nn.Linear(hidden_size, hidden_size)
                                  for _ in range(num_heads))
        for layer in self.down:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def hidden(self, k: int, f: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Head k's state [N, H] from f [N, H] and the k tokens after f's token [N, k], in
        the heads' own dtype (float32 in training; the target's matrices stay in the dtype
        they are served in)."""
        dtype = self.down[k - 1].weight.dtype
        f = f.to(dtype)
        grounded = (torch.cat((f, self.embed[tokens].to(dtype).flatten(1)), dim=-1)
                    if self.grounded else f)
        return f + self.down[k - 1](F.silu(self.up[k - 1](grounded)))

    def logits(self, k: int, f: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Head k's logits [N, columns] (float32), through the target's LM head (its rows of
        the draft vocabulary)."""
        h = self.hidden(k, f, tokens)
        return (h.to(self.lm_head.dtype) @ self.lm_head.T).float()
