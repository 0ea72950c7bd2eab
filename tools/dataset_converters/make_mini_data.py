"""Write the generated mini datasets (ImageNet, transfer, COCO, ADE20K layouts).

Example::

    python tools/dataset_converters/make_mini_data.py --out data/mini
    python tools/dataset_converters/make_mini_data.py --out data/mini --only coco --seed 1

Sets already written with the same parameters are left as they are.
"""
import argparse

from linvit_mm.testing.mini_data import SET_GROUPS, make_mini_all


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Write the linvit_mm mini datasets')
    parser.add_argument('--out', default='data/mini', help='root folder of the mini sets')
    parser.add_argument('--seed', type=int, default=0, help='generation seed')
    parser.add_argument('--only', choices=tuple(SET_GROUPS),
                        help='write only the classification sets, COCO or ADE20K')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    summaries = make_mini_all(args.out, seed=args.seed, only=args.only)
    total = 0
    for name, summary in summaries.items():
        splits = ', '.join(f'{split} {count}' for split, count in summary['splits'].items())
        print(f'{name:<18} {summary["format"]:<9} {len(summary["classes"])} classes, '
              f'images: {splits}; {summary["num_files"]} files, '
              f'{summary["num_bytes"] / 1024:.0f} KiB -> {summary["root"]}')
        total += summary['num_bytes']
    print(f'total {total / 1024:.0f} KiB')


if __name__ == '__main__':
    main()
