"""Tasks (prompts, references, environments) and their rewards, shared by rollout and trainer."""
