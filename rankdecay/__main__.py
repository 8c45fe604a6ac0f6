"""``python -m rankdecay ...`` (also how ``torchrun -m rankdecay train`` starts)."""
import sys

from .cli import main

sys.exit(main())
