import sys

from services.adapter_store.service import main

sys.exit(main())
