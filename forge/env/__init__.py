"""Multi-turn episodes with environments and tools (docs/environments.md).

- `config.EnvConfig`: the `env` config section (environment class and tools by import path, limits).
- `tools`: tool schemas from signatures and docstrings; calls whose failures become answers.
- `parse`: tool calls in sampled text (Hermes/Qwen `<tool_call>` tags, plain JSON).
- `chat`: prompt and tool-turn tokens from the chat template (its token diff, checked prefix-preserving).
- `episode`: the rollout loop, one token sequence per episode with its loss mask.
- `rewards.env_reward`: the environment's own reward as a verifier.

Episodes run on the hf or the vLLM backend, in this process or in Ray's rollout actors (`forge.workers.RolloutWorker`
plays them where it samples); OpenEnv servers are not built yet.
"""
