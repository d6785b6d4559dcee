"""Adapters for the environment libraries people already have (docs/environments.md), one module each, each
importing its library only when used (an optional extra):

reasoning_gym: reasoning-gym datasets as prompt/answer RL tasks scored by their own `score_answer`.
textarena: textarena games as `ludic_fast.agents` environments (single-player, or against a fixed opponent).
"""
