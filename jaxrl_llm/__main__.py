import sys

from jaxrl_llm.cli import main

sys.exit(main())
