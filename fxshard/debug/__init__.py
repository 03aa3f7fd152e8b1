"""Reading a transformed program: what it does and why, without running it.

``dump`` (one row per node: layouts, shapes, source), ``explain`` (why a value has its
layout, plan entry by plan entry), ``comm_summary`` (the static report of every collective
per step and its bytes), ``formats`` (JSON, networkx, Graphviz dot, HTML),
``graph_walk`` (walking into blocks, by the module each node came from).
"""
