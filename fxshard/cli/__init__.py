"""``python -m fxshard``: ``commands`` (``dump`` of a model under a plan), ``demo`` (the
README's main job), ``launch`` (spawning ranks for them)."""
