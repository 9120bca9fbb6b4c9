from nemesis.cli import main

raise SystemExit(main())
