from kvstreams.cli import main

raise SystemExit(main())
