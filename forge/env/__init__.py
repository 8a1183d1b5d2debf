"""Multi-turn episodes with environments and tools (docs/environments.md).

- `config.EnvConfig`: the `env` config section (environment class and tools by import path, limits).
- `tools`: tool schemas from signatures and docstrings; calls whose failures become answers.
- `parse`: tool calls in sampled text (Hermes/Qwen `<tool_call>` tags, plain JSON).
- `chat`: prompt and tool-turn tokens from the chat template (its token diff, checked prefix-preserving).
- `episode`: the rollout loop, one token sequence per episode with its loss mask.
- `rewards.env_reward`: the environment's own reward as a verifier.
- `openenv`: OpenEnv servers as environments, one WebSocket session per episode (started on 127.0.0.1 or at a URL).
- `builtin`: built-in tools (`python`: code in the code_exec sandbox).
- `agent`, `agent_chat`, `openai_server`: agents written against the OpenAI API (`env.agent`), played against an
  OpenAI-compatible endpoint served from the policy, their requests' tokens recorded.

Episodes run on the hf or the vLLM backend, in this process or in Ray's rollout actors (`forge.workers.RolloutWorker`
plays them where it samples), the OpenEnv servers' episodes too.
"""
