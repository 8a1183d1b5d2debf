"""`env`: the environment and tools of multi-turn episodes (forge/env/episode.py). Stdlib only: `forge.config`
imports it without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from forge.config_base import ranged, require


@dataclass(kw_only=True)
class EnvConfig:
    environment_factory: str = ""
    """Import path 'pkg.mod:Class' of a TRL-style environment class (no-argument constructor, reset(**row), every
    public method a tool; docs/environments.md); empty = none."""
    tools: list[str] = field(default_factory=list)
    """Import paths 'pkg.mod:fn' of stateless tool functions (typed arguments and a docstring with an Args section)."""
    max_turns: int = ranged(4, ">= 1")
    """Policy turns per episode; an episode still calling tools after this many is cut (truncated)."""
    max_tokens: int = ranged(0, ">= 0", "(0 = 4 x rollout.max_new_tokens)")
    """Token budget of an episode after its prompt, sampled and tool tokens together (0 = 4 x rollout.max_new_tokens);
    an episode that reaches it is cut (truncated)."""
    tool_timeout_s: float = ranged(10.0, ">= 0", "seconds (0 = no limit)")
    """Seconds one tool call may take; past it the model gets an error message as the tool's answer."""
    episode_timeout_s: float = ranged(0.0, ">= 0", "seconds (0 = no limit)")
    """Wall-clock seconds an episode may run (sampling and tools); one past it is cut after its current turn."""
    mask_truncated: bool = True
    """Take episodes cut by a limit out of the loss (their loss mask is 0); they are still counted (env/truncated)."""

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn episodes (an environment or tools are configured)."""
        return bool(self.environment_factory or self.tools)

    def check(self, prefix: str) -> None:
        twice = len(set(self.tools)) != len(self.tools)
        require(not twice, f"{prefix}tools", "lists a tool twice: list it once")
