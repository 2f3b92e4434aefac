"""What stays in attention: host rules first (the pager), model advice second (the selectors).

Nothing here touches tensors; the engine carries the decisions out on a backend.
"""
