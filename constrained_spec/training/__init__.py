"""Training what the engine serves with, using the engine: above it, as the command line is.

  eagle.py          `constrained-spec train-eagle`: an EAGLE head by self-distillation on answers
                    the target generates with the engine (settings in eagle_config.py, which the
                    command line reads without importing torch)
"""
