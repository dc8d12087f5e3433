"""Environment adapters: verifiers (verifiers_env), OpenEnv (openenv_env), MCP tools (docs/environments.md)."""
