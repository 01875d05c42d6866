"""Agents trained unchanged (`task.agent`, and a verifiers environment, its own agent): the seam
(`base.py`: `Agent`, `AgentFailure`), its members (`python.py`, `command.py`, `remote.py` with
the runner it talks to, `runner.py` = `asyncrl agent-server`, `verifiers.py` with
`vf_runner.py`), their config (`config.py`), and the episode that drives any of them over the
worker's gateway (`episode.py`). The task builder (`asyncrl.tasks.build`) picks the member;
nothing here imports a task or the rollout role."""
