"""Jamba's Mamba mixer, continued from a cached SSM state over several tokens.

transformers 5.24's `JambaMambaMixer` starts its multi-token selective scan from zero
(`mamba_selective_scan` takes no initial state) and uses the cached state only for single-token
steps, so a chunked capture, or a replay of more than one token, would forget the prompt's SSM state
(its own chunked prefill has the same flaw). Inside a longstraw forward, `JambaMixer` (put by
`longstraw.prepare` in front of the module's class) runs the module's own projections, convolution and
norms as its forward does, then the same recurrence starting from the cached state: h_t = exp(Δ_t A) h_{t−1}
+ Δ_t B_t x_t, y_t = C_t h_t + D x_t, gated by silu(z_t). The state is one `[B, d_inner, d_state]` tensor:
O(1) in P. Everywhere else (outside longstraw, a first chunk without a state, single-token steps) it is
the module's own forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..hf.cache import active_cache


def selective_scan(x, dt, A, B, C, D, z, dt_bias, state):
    """The recurrence of transformers' `mamba_selective_scan` (its sequential path), from `state`.

    x, z `[b, d, T]`; dt `[b, d, T]` (before bias and softplus); A `[d, n]`; B, C `[b, n, T]`; D `[d]`;
    state `[b, d, n]`. Returns (y `[b, d, T]`, final state)."""
    dtype = x.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)  # [b, T, n]
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [b, d, T, n]
    inputs = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    h = state.to(dtype)
    ys = []
    for t in range(x.shape[-1]):
        h = decay[:, :, t] * h + inputs[:, :, t]
        ys.append(torch.matmul(h.to(dtype), C[:, t, :].unsqueeze(-1))[:, :, 0])
    y = torch.stack(ys, dim=-1)
    y = y + x * D[None, :, None]
    return y * F.silu(z), h


class JambaMixer:
    """Mixin in front of `JambaMambaMixer` (see the module docstring)."""

    longstraw_base: type = object

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        seq_len = hidden_states.shape[1]
        state = None
        if active_cache() is not None and cache is not None and seq_len > 1:
            state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
        if state is None:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        fns = sys.modules[self.longstraw_base.__module__]  # the modeling module's own helpers (5.24)
        dtype = hidden_states.dtype
        hidden_states = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
        projected = self.in_proj(hidden_states).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        x, gate = projected.chunk(2, dim=1)
        x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        x = fns.causal_conv1d_fn(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation)
        x = fns.apply_mask_to_padding_states(x[:, :, -seq_len:].transpose(1, 2), attention_mask)
        time_step, B, C = torch.split(
            self.x_proj(x), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )
        time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
        time_step = self.dt_proj.weight @ time_step.transpose(1, 2)
        dt_bias = self.dt_proj.bias.float() if self.dt_proj.bias is not None else None
        y, final = selective_scan(
            x.transpose(1, 2), time_step, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), gate, dt_bias, state
        )
        cache.update_recurrent_state(final, self.layer_idx)
        return self.out_proj(y.transpose(1, 2).to(dtype))
