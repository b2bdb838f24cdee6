"""``python -m megatronapp.data`` = ``python -m megatronapp.data.preprocess``."""

from .preprocess import main

raise SystemExit(main())
