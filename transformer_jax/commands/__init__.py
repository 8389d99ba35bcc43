"""The command-line programs, one module each: flags, checks of the flags, and a call into the
library. `python -m transformer_jax COMMAND --help` lists a command's flags."""
