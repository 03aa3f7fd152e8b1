"""``python -m fxshard``: ``commands`` (``dump`` of a model under a plan), ``demo`` (the
README's main job), ``train`` / ``export`` (the trainer), ``plan`` (the planner).  Ranks are
spawned by :mod:`fxshard.testing.launch`."""
