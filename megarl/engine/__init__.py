"""The Megatron-core engines (actor, reference, critic, reward model) and what they are built from."""

from megarl.engine import deferred_compile

deferred_compile.install()  # before any engine module imports megatron.core
