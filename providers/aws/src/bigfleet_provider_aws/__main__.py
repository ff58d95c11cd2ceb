from bigfleet_provider_aws.cli import main

raise SystemExit(main())
