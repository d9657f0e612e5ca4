"""Command-line tools: the `dynamix-hvd` CLI (`cli`) and the launch and build checks (`launchcheck`,
`buildcheck`). Nothing in the training path imports these.
"""
