from p2pkv.cli.main import main

raise SystemExit(main())
