"""The acceptance link: who decides a run got better. Held-out sets sampled and checked by checkers
written apart from the training reward (`acceptance`, `settings`), intervals (`stats`), the alarms a
run rings while it trains (`alarms`, `signal`), and the questions asked after it (`checklist`,
`run_comparison`, `review`, `demo_report`); each recipe's held-out evaluation (`sft`, `preference`,
`reward_model`). docs/acceptance.md is the page."""
