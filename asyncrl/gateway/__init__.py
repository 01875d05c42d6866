"""The agent gateway: an agent's OpenAI chat calls served by the rollout engine and captured
token-exact (`transcript.py`)."""
