import unittest

from versions import compare, newest


class CompareTest(unittest.TestCase):
    def test_equal_versions(self) -> None:
        self.assertEqual(compare("1.2.3", "1.2.3"), 0)

    def test_a_leading_v_is_ignored(self) -> None:
        self.assertEqual(compare("v2.0.0", "2.0.0"), 0)

    def test_parts_compare_as_numbers(self) -> None:
        self.assertEqual(compare("1.10.0", "1.9.0"), 1)
        self.assertEqual(compare("0.9.12", "0.10.0"), -1)

    def test_a_pre_release_comes_before_its_release(self) -> None:
        self.assertEqual(compare("2.0.0-rc1", "2.0.0"), -1)
        self.assertEqual(compare("2.0.0", "2.0.0-rc1"), 1)

    def test_pre_releases_compare_by_number(self) -> None:
        self.assertEqual(compare("2.0.0-rc2", "2.0.0-rc10"), -1)


class NewestTest(unittest.TestCase):
    def test_newest_of_several(self) -> None:
        self.assertEqual(newest(["1.9.0", "1.10.0-rc1", "1.10.0", "1.2.0"]), "1.10.0")

    def test_newest_of_none(self) -> None:
        self.assertIsNone(newest([]))
