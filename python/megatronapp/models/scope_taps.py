"""The one global the model's tap points read: the active scope, or None.

Kept in its own module with no imports so that ``megatronapp.models`` can
read it without importing the scope (which imports the models). With no
active scope each tap point is one attribute load and a comparison.
"""

#: The :class:`megatronapp.scope.Scope` capturing the current forward, or None.
ACTIVE = None
