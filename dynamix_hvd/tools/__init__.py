"""Command-line tools: the `dynamix-hvd` CLI (`cli`), launch and build checks (`launchcheck`,
`buildcheck`), the progress display (`progress`) and policy inspection (`policy_tools`). Nothing in
the training path imports these, except `progress` for the display.
"""
