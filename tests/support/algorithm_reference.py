"""Slow, obviously-correct reference loops for every vectorised function of stppo_agent.algorithms,
and a generator of random multi-turn batch layouts (padding, observation gaps, empty and 1-token turns)."""

from __future__ import annotations

import math
import random

import torch


def random_layout(rng: random.Random, batch: int, length: int, max_turns: int = 8):
    """loss_mask (B, T) bool and turn_ids (B, T) long with -1 off the mask.

    Each row: a few policy tokens of turn 0, an observation gap, turn 1, ...; turns may be empty (their id is
    then skipped) or a single token; the rest is padding.
    """
    mask = torch.zeros(batch, length, dtype=torch.bool)
    turns = torch.full((batch, length), -1, dtype=torch.long)
    for b in range(batch):
        position = 0
        for k in range(rng.randint(1, max_turns)):
            size = rng.choice([0, 1, 1, 2, rng.randint(1, 6)])
            for _ in range(size):
                if position < length:
                    mask[b, position], turns[b, position] = True, k
                    position += 1
            position += rng.randint(0, 4)  # observation tokens inserted by the env
    return mask, turns


def ref_gae(rewards, values, mask, gamma, lam, kl_penalty=None):
    batch, length = mask.shape
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for b in range(batch):
        positions = [t for t in range(length) if mask[b, t]]
        next_advantage = 0.0
        for j in reversed(range(len(positions))):
            t = positions[j]
            reward = float(rewards[b]) if j == len(positions) - 1 else 0.0
            if kl_penalty is not None:
                reward -= float(kl_penalty[b, t])
            next_value = float(values[b, positions[j + 1]]) if j + 1 < len(positions) else 0.0
            delta = reward + gamma * next_value - float(values[b, t])
            next_advantage = delta + gamma * lam * next_advantage
            advantages[b, t] = next_advantage
            returns[b, t] = next_advantage + float(values[b, t])
    return advantages, returns


def ref_whiten(x, mask, eps=1e-8):
    items = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m]
    mean = sum(items) / len(items)
    var = sum((v - mean) ** 2 for v in items) / max(1, len(items) - 1)
    out = torch.zeros_like(x)
    for index in zip(*torch.nonzero(mask, as_tuple=True)):
        out[index] = (float(x[index]) - mean) / math.sqrt(var + eps)
    return out


def ref_group_advantages(rewards, group_ids, mask, mode, std_normalize=True):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(len(rewards)):
        members = [float(rewards[i]) for i in range(len(rewards)) if group_ids[i] == group_ids[b]]
        if len(members) == 1:
            advantage = 0.0
        elif mode == "grpo":
            mean = sum(members) / len(members)
            std = math.sqrt(sum((r - mean) ** 2 for r in members) / (len(members) - 1))
            advantage = float(rewards[b]) - mean
            if std_normalize:
                advantage /= std + 1e-6
        else:  # rloo
            others = list(members)
            others.remove(float(rewards[b]))
            advantage = float(rewards[b]) - sum(others) / len(others)
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = advantage
    return out


def ref_log_ratio(logprobs, old_logprobs, mask, turns, level):
    out = torch.zeros_like(logprobs)
    batch, length = mask.shape
    for b in range(batch):
        for t in range(length):
            if not mask[b, t]:
                continue
            if level == "token":
                members = [t]
            elif level == "turn":
                members = [s for s in range(length) if mask[b, s] and turns[b, s] == turns[b, t]]
            else:
                members = [s for s in range(length) if mask[b, s]]
            out[b, t] = sum(float(logprobs[b, s] - old_logprobs[b, s]) for s in members) / len(members)
    return out


def ref_ppo_clip(logprobs, old_logprobs, advantages, mask, turns, level, eps_low, eps_high, agg):
    """(loss, bias_surrogate, clip_frac) as floats."""
    log_ratio = ref_log_ratio(logprobs, old_logprobs, mask, turns, level)
    losses, biases, clipped_count = {}, {}, 0
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        b, t = int(b), int(t)
        rho = math.exp(float(log_ratio[b, t]))
        a = float(advantages[b, t])
        clipped_rho = min(max(rho, 1 - eps_low), 1 + eps_high)
        losses[b, t] = -min(rho * a, clipped_rho * a)
        c = (a > 0 and rho > 1 + eps_high) or (a < 0 and rho < 1 - eps_low)
        biases[b, t] = rho * a if c else 0.0
        clipped_count += int(c)
    return ref_aggregate(losses, mask, agg), ref_aggregate(biases, mask, agg), clipped_count / max(1, len(losses))


def ref_aggregate(per_token: dict, mask, agg):
    if agg == "token-mean":
        return sum(per_token.values()) / max(1, len(per_token))
    rows = {}
    for (b, _), value in per_token.items():
        rows.setdefault(b, []).append(value)
    return sum(sum(v) / len(v) for v in rows.values()) / max(1, len(rows))


def ref_value_loss(values, old_values, returns, mask, eps):
    total, count = 0.0, 0
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        v, v_old, r = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
        v_clipped = min(max(v, v_old - eps), v_old + eps)
        total += 0.5 * max((v - r) ** 2, (v_clipped - r) ** 2)
        count += 1
    return total / max(1, count)


# --- the 2025-26 stabilisers (tests/algorithms/test_stabilizers.py) ---------------------------------------------------
# Each builds its loss from scalar tensor ops, one token at a time, so autograd through the loop gives an
# independent reference gradient.

def ref_members(mask, turns, level, b, t):
    """Positions of (b, t)'s segment at ``level``."""
    if level == "token":
        return [t]
    positions = [s for s in range(mask.shape[1]) if mask[b, s]]
    return [s for s in positions if turns[b, s] == turns[b, t]] if level == "turn" else positions


def ref_segment_mean(x, mask, turns, level, b, t):
    members = ref_members(mask, turns, level, b, t)
    return sum(x[b, s] for s in members) / len(members)


def ref_aggregate_scaled(per_token: dict, agg, scale=1.0, weights=None):
    """agg of the per-token terms, each times its weight when ``weights`` (B, T) are given."""
    if weights is not None:
        per_token = {key: value * float(weights[key]) for key, value in per_token.items()}
    if agg != "seq-mean-token-sum-norm":
        return ref_aggregate(per_token, None, agg)
    rows = {}
    for (b, _), value in per_token.items():
        rows.setdefault(b, []).append(value)
    return sum(sum(v) / scale for v in rows.values()) / max(1, len(rows))


def _policy_tokens(mask):
    return [(int(b), int(t)) for b, t in zip(*torch.nonzero(mask, as_tuple=True))]


def _level_log_ratio(logprobs, old, mask, turns, level, b, t):
    value = ref_segment_mean(logprobs - old, mask, turns, level, b, t)
    return value.clamp(-20.0, 20.0)


def ref_cispo(logprobs, old, advantages, mask, turns, level, eps_low, eps_high, agg="token-mean", weights=None):
    losses = {}
    for b, t in _policy_tokens(mask):
        rho = float(torch.exp(_level_log_ratio(logprobs.detach(), old, mask, turns, level, b, t)))
        weight = min(max(rho, 1 - eps_low), 1 + eps_high)
        losses[b, t] = -weight * float(advantages[b, t]) * logprobs[b, t]
    return ref_aggregate_scaled(losses, agg, weights=weights)


def ref_ppo_dual_clip(logprobs, old, advantages, mask, turns, level, eps_low, eps_high, clip_c, agg="token-mean"):
    """ppo_clip with verl's dual clip, from scalar tensor ops: (loss, bias surrogate, clip_frac, dual_clip_frac).
    For A < 0 the token's loss is min(-c A, -min(rho A, clip(rho) A)): past rho = c it is the constant -c A, and
    the rho A it gave up is part of the clipping bias, like an ordinary clip's."""
    losses, biases, clipped, dual = {}, {}, 0, 0
    tokens = _policy_tokens(mask)
    for b, t in tokens:
        rho = torch.exp(_level_log_ratio(logprobs, old, mask, turns, level, b, t))
        a, value = float(advantages[b, t]), float(rho.detach())
        surrogate = -torch.minimum(rho * a, rho.clamp(1 - eps_low, 1 + eps_high) * a)
        is_dual = a < 0 and value > clip_c
        losses[b, t] = torch.tensor(-clip_c * a, dtype=old.dtype) if is_dual else surrogate
        is_clipped = (a > 0 and value > 1 + eps_high) or (a < 0 and value < 1 - eps_low) or is_dual
        biases[b, t] = rho * a if is_clipped else torch.zeros((), dtype=old.dtype)
        clipped, dual = clipped + is_clipped, dual + is_dual
    count = max(1, len(tokens))
    return ref_aggregate_scaled(losses, agg), ref_aggregate_scaled(biases, agg), clipped / count, dual / count


def ref_effective_sample_size(logprobs, old, mask, turns, level):
    """(sum w)^2 / (n sum w^2) over one weight per token, turn or trajectory (1 for none)."""
    weights = {}
    for b, t in _policy_tokens(mask):
        key = (b, t) if level == "token" else (b, int(turns[b, t])) if level == "turn" else (b,)
        weights[key] = math.exp(float(_level_log_ratio(logprobs, old, mask, turns, level, b, t)))
    if not weights:
        return 1.0
    values = list(weights.values())
    return sum(values) ** 2 / (len(values) * sum(w * w for w in values))


def ref_sapo(logprobs, old, advantages, mask, turns, level, tau_pos, tau_neg, agg="seq-mean-token-mean",
             weights=None):
    losses = {}
    for b, t in _policy_tokens(mask):
        rho = torch.exp(_level_log_ratio(logprobs, old, mask, turns, level, b, t))
        a = float(advantages[b, t])
        tau = tau_pos if a > 0 else tau_neg
        losses[b, t] = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * a
    return ref_aggregate_scaled(losses, agg, weights=weights)


def ref_gmpo(logprobs, old, advantages, mask, turns, level, eps_low, eps_high, agg="seq-mean-token-mean",
             weights=None):
    clipped = {}
    for b, t in _policy_tokens(mask):
        log_ratio, a = logprobs[b, t] - old[b, t], float(advantages[b, t])
        if a > 0:
            bound = torch.tensor(eps_high, dtype=old.dtype)
            clipped[b, t] = log_ratio if float(log_ratio.detach()) <= eps_high else bound
        elif a < 0:
            bound = torch.tensor(-eps_low, dtype=old.dtype)
            clipped[b, t] = log_ratio if float(log_ratio.detach()) >= -eps_low else bound
        else:
            clipped[b, t] = torch.zeros((), dtype=old.dtype)
    losses = {}
    for b, t in _policy_tokens(mask):
        members = ref_members(mask, turns, level, b, t)
        ratio = torch.exp(sum(clipped[b, s] for s in members) / len(members))
        losses[b, t] = -float(advantages[b, t]) * ratio
    return ref_aggregate_scaled(losses, agg, weights=weights)


def ref_dppo(kind, logprobs, old, advantages, mask, turns, level, eps_low, eps_high, cap, agg="token-mean",
             weights=None):
    losses = {}
    for b, t in _policy_tokens(mask):
        new_log = float(ref_segment_mean(logprobs.detach(), mask, turns, level, b, t))
        old_log = float(ref_segment_mean(old, mask, turns, level, b, t))
        p, p_old = math.exp(new_log), math.exp(old_log)
        rho = math.exp(min(max(new_log - old_log, -20.0), 20.0))
        a = float(advantages[b, t])
        if kind == "tv":
            valid = p - p_old <= eps_high if a > 0 else p - p_old >= -eps_low
        else:
            binary_kl = p_old * (old_log - new_log) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            valid = (binary_kl <= eps_high or p <= p_old) if a > 0 else (binary_kl <= eps_low or p >= p_old)
        losses[b, t] = -a * min(rho, cap) * float(valid) * logprobs[b, t]
    return ref_aggregate_scaled(losses, agg, weights=weights)


def ref_m2po_keep(logprobs, old, mask, turns, level, threshold):
    """{(b, t): kept} by the greedy of the M2PO paper over segments weighted by their tokens."""
    segments = {}
    for b, t in _policy_tokens(mask):
        key = (b, t) if level == "token" else (b, int(turns[b, t])) if level == "turn" else (b,)
        segments.setdefault(key, []).append((b, t))
    items = []
    for key, tokens in segments.items():
        b, t = tokens[0]
        value = float(_level_log_ratio(logprobs, old, mask, turns, level, b, t)) ** 2
        items.append((value, len(tokens), key))
    items.sort(key=lambda item: -item[0])
    dropped = len(items) - 1
    for k in range(len(items)):
        rest = items[k:]
        if sum(v * n for v, n, _ in rest) / sum(n for _, n, _ in rest) < threshold:
            dropped = k
            break
    dropped_keys = {key for _, _, key in items[:dropped]}
    return {token: key not in dropped_keys for key, tokens in segments.items() for token in tokens}


def ref_m2po(logprobs, old, advantages, mask, turns, level, threshold, agg="token-mean", weights=None):
    keep = ref_m2po_keep(logprobs.detach(), old, mask, turns, level, threshold)
    losses = {}
    for b, t in _policy_tokens(mask):
        rho = torch.exp(_level_log_ratio(logprobs, old, mask, turns, level, b, t))
        losses[b, t] = -float(keep[b, t]) * rho * float(advantages[b, t])
    return ref_aggregate_scaled(losses, agg, weights=weights)


def ref_ppo_clip_loss(logprobs, old, advantages, mask, turns, level, eps_low, eps_high, agg="token-mean",
                     weights=None):
    """The clipped surrogate one token at a time from scalar tensor ops (autograd gives the reference gradient)."""
    losses = {}
    for b, t in _policy_tokens(mask):
        rho = torch.exp(_level_log_ratio(logprobs, old, mask, turns, level, b, t))
        a = float(advantages[b, t])
        losses[b, t] = -torch.minimum(rho * a, rho.clamp(1 - eps_low, 1 + eps_high) * a)
    return ref_aggregate_scaled(losses, agg, weights=weights)


def ref_turn_gae(rewards, values, mask, turns, gamma, lam, kl_penalty=None):
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for b in range(mask.shape[0]):
        by_turn = {}
        for t in range(mask.shape[1]):
            if mask[b, t]:
                by_turn.setdefault(int(turns[b, t]), []).append(t)
        order = sorted(by_turn)
        next_advantage, next_value = 0.0, 0.0
        for i in reversed(range(len(order))):
            positions = by_turn[order[i]]
            reward = float(rewards[b]) if i == len(order) - 1 else 0.0
            if kl_penalty is not None:
                reward -= sum(float(kl_penalty[b, t]) for t in positions)
            value = float(values[b, positions[0]])
            next_advantage = reward + gamma * next_value - value + gamma * lam * next_advantage
            next_value = value
            for t in positions:
                advantages[b, t] = next_advantage
                returns[b, t] = next_advantage + value
    return advantages, returns


def ref_informative_groups(rewards, group_ids):
    keep = []
    for b in range(len(rewards)):
        members = [float(rewards[i]) for i in range(len(rewards)) if group_ids[i] == group_ids[b]]
        keep.append(max(members) > min(members))
    return torch.tensor(keep)
