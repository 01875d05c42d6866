"""The agent gateway: an OpenAI-compatible endpoint in the rollout worker through which agents
people already have are trained unchanged (`task.agent`): `server.py` (HTTP), `sessions.py`
(credentials, calls waiting on the engine), `agents.py` (the agent's runs, its samples),
`transcript.py` (each call captured token-exact, calls stitched into samples)."""
