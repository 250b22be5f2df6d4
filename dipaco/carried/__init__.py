"""A path's carried state: what a path carries between tasks besides its modules.

`validate` checks such a state as read from the store (an island wrote it, so it is untrusted input):
its AdamW moments, its error-feedback residual and its fragments' drift.
"""
