"""megarl: reinforcement-learning post-training of LLMs on Megatron-core with co-located rollouts.

Importing the package is cheap: megatron, sglang, transformer_engine, apex and ray are imported only by the
modules that drive them, when a run needs them.
"""

__version__ = "0.1.0"
