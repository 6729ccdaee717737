"""Pure: the fixed binary tree a K-invariant reduction adds unit gradients in (``perparam.invariant``).

``U`` units (a power of two) are the leaves; a node is ``left + right``. Rank ``r`` of ``K`` holds the
leaves ``r*U/K .. (r+1)*U/K - 1``, whose subtree sum is a node of the full tree, so adding the ``K`` subtree
sums pairwise (``tree_sum``) gives the full tree's sum bit for bit, for every ``K`` dividing ``U``.
``TreeStack`` adds leaves as they arrive with a binary-counter stack: at most ``log2(n) + 1`` partial sums
held for ``n`` leaves (``log2(n)`` where each odd leaf is added into its left sibling as it is made:
``take_leaf``)."""

from __future__ import annotations


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


class TreeStack:
    """Leaves pushed in order; ``result()`` is their balanced-tree sum (``len`` a power of two).
    ``add(a, b)`` returns ``a + b`` (it may write ``a`` in place)."""

    def __init__(self, add=lambda a, b: a + b) -> None:
        self._add = add
        self._stack: list[tuple[int, object]] = []  # (level, partial sum)

    def push(self, leaf, level: int = 0) -> None:
        """Add a node: a leaf (``level`` 0), or the sum of the ``2**level`` leaves that follow the ones pushed
        (a leaf from ``take_leaf`` with the next leaf added to it: ``level`` 1)."""
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            leaf = self._add(left, leaf)
            level += 1
        self._stack.append((level, leaf))

    def take_leaf(self):
        """The last leaf pushed, removed, when it waits for its right sibling (the top partial sum is a leaf);
        ``None`` otherwise. ``add(leaf, next leaf)`` pushed at level 1 is the same as pushing the two
        leaves."""
        if self._stack and self._stack[-1][0] == 0:
            return self._stack.pop()[1]
        return None

    @property
    def depth(self) -> int:
        """Partial sums held now."""
        return len(self._stack)

    def result(self):
        """The sum of every leaf pushed (exactly one partial sum left; ``ValueError`` otherwise: the leaf
        count was not a power of two, or none was pushed)."""
        if len(self._stack) != 1:
            raise ValueError(f"tree sum: {len(self._stack)} partial sums left; push a power-of-two number of "
                             "leaves")
        return self._stack.pop()[1]


def tree_sum(leaves, add=lambda a, b: a + b):
    """The balanced-tree sum of ``leaves`` (a power-of-two count): pairwise, level by level."""
    stack = TreeStack(add)
    for leaf in leaves:
        stack.push(leaf)
    return stack.result()
