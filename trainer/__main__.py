import sys

from parwatch.trainer.launch import main

sys.exit(main())
